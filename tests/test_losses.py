"""The trainer's per-token loss against transformers' own loss on the same model and labels."""

from __future__ import annotations

import pytest
import torch

from train.common import losses
from train.common.losses import LossImplError, select_loss_impl, token_losses
from train.common.packing import IGNORE_INDEX
from train.stage1.model import build_model
from train.stage1.objective import CausalLMObjective


def test_objective_matches_transformers_loss():
    torch.manual_seed(0)
    model, _ = build_model("tiny")
    model.eval()
    ids = torch.randint(0, 4000, (2, 24))
    labels = ids.clone()
    labels[:, :3] = IGNORE_INDEX
    labels[1, 10] = IGNORE_INDEX
    with torch.no_grad():
        expected = model(input_ids=ids, labels=labels).loss
        per_token = CausalLMObjective(model, "logits")(input_ids=ids, labels=labels)
    assert per_token.shape == (2, 23) and per_token.dtype == torch.float32
    valid = labels[:, 1:] != IGNORE_INDEX
    assert torch.all(per_token[~valid] == 0)
    torch.testing.assert_close(per_token.sum() / valid.sum(), expected, atol=1e-5, rtol=1e-5)


def test_loss_impl_selection_on_cpu():
    cpu = torch.device("cpu")
    assert select_loss_impl(cpu, "auto") == "logits"
    with pytest.raises(LossImplError, match="needs a CUDA device"):
        select_loss_impl(cpu, "cce")
    with pytest.raises(LossImplError, match="unknown loss implementation"):
        select_loss_impl(cpu, "fast")
    with pytest.raises(LossImplError):
        token_losses(torch.zeros(1, 2, 4), torch.zeros(8, 4), torch.zeros(1, 2, dtype=torch.long), "bogus")


def test_auto_tries_the_sm90_kernels_only_on_hopper_for_a_uniformly_weighted_loss(monkeypatch):
    """SM90_PREFERENCE (empty until the H200 bench picks one) comes first for stage-1's sum / count
    loss on sm_90 alone: never for DFlash (it weighs positions; the kernel's dW assumes equal
    weights), never off Hopper. The probes are real (here none of the fused kernels need import):
    the spy records which ones `auto` tried, in order. The GPU's capability is the stand-in."""
    tried: list[str] = []
    real_probe = losses._probe
    monkeypatch.setattr(losses, "_probe", lambda impl: tried.append(impl) or real_probe(impl))
    monkeypatch.setattr(losses, "SM90_PREFERENCE", ("liger-sm90-tce",))
    cuda = torch.device("cuda")
    for hopper, uniform, first in ((True, True, "liger-sm90-tce"), (True, False, "cce"), (False, True, "cce")):
        monkeypatch.setattr(losses, "is_sm90", lambda device, hopper=hopper: hopper)
        tried.clear()
        got = select_loss_impl(cuda, "auto", uniform_weights=uniform)
        assert tried[0] == first and got in (*tried, "logits"), (hopper, uniform, tried, got)
        assert ("liger-sm90-tce" in tried) == (hopper and uniform)


# ---------------------------------------------------------------------------------------------
# The fused path's operands. cut-cross-entropy's Triton kernel cannot run on this CPU machine, so
# `kernel` below stands in for it: it records the operands it is handed and computes the same loss
# in torch (losses.reference_linear_cross_entropy: bf16 operands, fp32 products and log-sum-exp),
# and, like cut-cross-entropy's backward, refuses fp32 embeddings. It does not model the kernel's
# own blocking, its gradient filtering (filter_eps) or its speed.


@pytest.fixture
def kernel(monkeypatch):
    seen: list[tuple[torch.dtype, torch.dtype, bool]] = []

    def cce_stand_in(e, c, targets):
        seen.append((e.dtype, c.dtype, e.is_contiguous()))
        return losses.reference_linear_cross_entropy(e, c, targets)

    monkeypatch.setitem(losses.FUSED_KERNELS, "cce", cce_stand_in)
    return seen


def test_reference_refuses_fp32_embeddings_as_cut_cross_entropy_does():
    e, c = torch.randn(4, 8), torch.randn(16, 8)
    with pytest.raises(LossImplError, match="bf16 or fp16"):
        losses.reference_linear_cross_entropy(e, c, torch.zeros(4, dtype=torch.long))


def test_stage1_fused_path_gets_bf16_under_fp32_autocast_and_matches_logits(kernel):
    """fp32 weights under bf16 autocast (the RMSNorm returns fp32 hidden states): the kernel gets
    bf16 operands, and loss and gradients equal the fp32 logits path within bf16 tolerance."""
    torch.manual_seed(0)
    model, _ = build_model("tiny")
    ids = torch.randint(0, 4000, (2, 24))
    labels = ids.clone()
    labels[:, :3] = IGNORE_INDEX
    results = {}
    for impl in ("logits", "cce"):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=impl == "cce"):
            per_token = CausalLMObjective(model, impl)(input_ids=ids, labels=labels)
        per_token.sum().backward()
        results[impl] = (per_token.detach(), model.lm_head.weight.grad.clone(),
                         model.model.embed_tokens.weight.grad.clone())
    assert kernel and all(e == torch.bfloat16 and c == torch.bfloat16 and contig for e, c, contig in kernel)
    (want, want_head, want_emb), (got, got_head, got_emb) = results["logits"], results["cce"]
    assert got.dtype == torch.float32 and torch.all(got[labels[:, 1:] == IGNORE_INDEX] == 0)
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)
    for g, w in ((got_head, want_head), (got_emb, want_emb)):
        assert g.dtype == torch.float32
        assert float((g - w).norm() / w.norm()) < 0.05


def test_dflash_fused_loss_gets_bf16_and_matches_the_logits_path(kernel):
    """The drafter trains with fp32 weights under bf16 autocast against a frozen fp32 lm_head:
    the kernel gets bf16 rows and a bf16 lm_head (cast once, not per step), and the loss, its
    gradient and the slot accuracies equal the logits path's."""
    from train.dflash.model import TargetHead, drafter_loss

    torch.manual_seed(0)
    head = TargetHead(torch.randn(300, 64), torch.randn(300, 64) * 0.1)
    hidden = torch.randn(2, 5, 8, 64, requires_grad=True)
    labels = torch.randint(0, 300, (2, 5, 7))
    labels[1, 3:] = IGNORE_INDEX
    out = {}
    for impl in ("logits", "cce"):
        hidden.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, stats = drafter_loss(head, hidden, labels, None, 0.0, 7.0, loss_impl=impl)
        loss.backward()
        out[impl] = (loss.detach(), hidden.grad.clone(), stats)
    assert len(kernel) == 1 and kernel[0][:2] == (torch.bfloat16, torch.bfloat16)
    (l1, g1, s1), (l2, g2, s2) = out["logits"], out["cce"]
    torch.testing.assert_close(l2, l1, atol=0.02, rtol=0.01)
    assert float((g2 - g1).norm() / g1.norm()) < 0.05
    assert s1["acc_slot"] == s2["acc_slot"]
    assert head.lm_head.weight.dtype == torch.float32  # the head itself is untouched


def test_dflash_accuracy_metrics_on_a_strided_sample_of_rows(kernel, monkeypatch):
    """--acc-rows: the accuracy metrics' argmax pass (a second lm_head pass on the fused path) runs
    over the sampled rows only, the sample holds every slot and both batch rows, the metrics are
    those of the sampled rows on both paths, and the loss and its gradient do not change."""
    from train.dflash.model import TargetHead, drafter_loss

    torch.manual_seed(0)
    w = torch.nn.functional.normalize(torch.randn(300, 64), dim=-1)
    head = TargetHead(torch.randn(300, 64), w)
    # each row's argmax is unambiguous: the row is 5 x the head row of its predicted token
    pred = torch.randint(0, 300, (2, 20, 8))
    hidden = (5 * w[pred]).requires_grad_(True)
    labels = torch.randint(0, 300, (2, 20, 7))
    labels[:, :, :3] = pred[:, :, 1:4]  # slots 1-3 right, 4-7 wrong (labels differ from pred there)
    labels[:, :, 3:] = (pred[:, :, 4:] + 1) % 300
    labels[1, 15:] = IGNORE_INDEX
    verifier = 5 * w[pred[:, :, 1:]]
    verifier[1] = 5 * w[(pred[1, :, 1:] + 7) % 300]  # the target agrees on batch row 0 only
    n = int((labels != IGNORE_INDEX).sum())
    shapes: list[int] = []
    real_operands = losses.fused_operands

    def watched(e, c):
        shapes.append(e.shape[0])
        return real_operands(e, c)

    monkeypatch.setattr(losses, "fused_operands", watched)
    out = {}
    for impl in ("logits", "cce"):
        for rows in (None, 28):
            hidden.grad, shapes[:] = None, []
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss, stats = drafter_loss(head, hidden, labels, verifier, 0.0, 7.0, loss_impl=impl,
                                           metric_rows=rows)
            loss.backward()
            out[impl, rows] = (loss.detach(), hidden.grad.clone(), stats)
            if impl == "cce":  # the loss over every row, the argmax over the sampled rows only
                assert shapes == [n, rows or n]
    for impl in ("logits", "cce"):
        (l_all, g_all, s_all), (l_some, g_some, s_some) = out[impl, None], out[impl, 28]
        assert torch.equal(l_all, l_some) and torch.equal(g_all, g_some) and s_all["ce"] == s_some["ce"]
        assert s_all["acc_rows"] == n and s_some["acc_rows"] == 28
        for s in (s_all, s_some):  # every slot is in the sample: 3 right slots, 4 wrong ones
            assert s["acc_slot"] == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0], s["acc_slot"]
            assert s["tau"] == 4.0
        assert s_all["target_agree"] == 140 / n  # batch row 0's 20 x 7 rows of n
        assert abs(s_some["target_agree"] - 140 / n) <= 1 / 28 + 1e-9  # both batch rows in the sample
        assert abs(s_some["acc"] - 3 / 7) <= 2 / 28
    assert out["logits", 28][2]["acc_slot"] == out["cce", 28][2]["acc_slot"]
    assert out["logits", 28][2]["target_agree"] == out["cce", 28][2]["target_agree"]


def test_dflash_onepass_loss_equals_the_logits_path():
    """--loss-impl onepass (the frozen head's CE with its gradient made in the forward, no
    recompute) against the checkpointed logits path: the same loss, gradient, slot accuracies and
    target agreement under bf16 autocast, over several chunks and slot weights; no-grad too."""
    from train.dflash.model import TargetHead, drafter_loss

    torch.manual_seed(0)
    head = TargetHead(torch.randn(300, 64), torch.randn(300, 64) * 0.3)
    hidden = torch.randn(2, 5, 8, 64, requires_grad=True)
    labels = torch.randint(0, 300, (2, 5, 7))
    labels[1, 3:] = IGNORE_INDEX
    labels[0, 1, 4:] = IGNORE_INDEX
    verifier = torch.randn(2, 5, 7, 64)
    out = {}
    for impl, chunk in (("logits", None), ("onepass", None), ("onepass", 7)):
        hidden.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, stats = drafter_loss(head, hidden, labels, verifier, 0.0, 7.0, chunk_rows=chunk, loss_impl=impl)
        loss.backward()
        out[impl, chunk] = (loss.detach(), hidden.grad.clone(), stats)
    l1, g1, s1 = out["logits", None]
    assert float(g1.norm()) > 0
    for key in (("onepass", None), ("onepass", 7)):
        l2, g2, s2 = out[key]
        torch.testing.assert_close(l2, l1, atol=2e-3, rtol=2e-3)
        assert float((g2 - g1).norm() / g1.norm()) < 1e-2, key
        assert s2["acc_slot"] == s1["acc_slot"] and s2["target_agree"] == s1["target_agree"]
        assert abs(s2["ce"] - s1["ce"]) < 2e-2
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = drafter_loss(head, hidden, labels, None, 0.0, 7.0, chunk_rows=7, loss_impl="onepass")
    torch.testing.assert_close(loss, l1, atol=2e-3, rtol=2e-3)


def test_frozen_weight_is_cast_once_and_again_after_it_changes():
    w = torch.randn(32, 8)
    e = torch.randn(4, 8)
    _, c1 = losses.fused_operands(e, w)
    _, c2 = losses.fused_operands(e, w)
    assert c1.dtype == torch.bfloat16 and c1 is c2
    with torch.no_grad():
        w.mul_(2)
    _, c3 = losses.fused_operands(e, w)
    assert c3 is not c1 and torch.equal(c3, w.to(torch.bfloat16))
    trainable = torch.randn(32, 8, requires_grad=True)
    e16 = torch.randn(4, 8, dtype=torch.float16)
    e_out, c_out = losses.fused_operands(e16, trainable)
    assert e_out.dtype == c_out.dtype == torch.float16 and c_out.requires_grad


# ---------------------------------------------------------------------------------------------
# liger-sm90 (train/common/liger_sm90.py): Liger's Hopper CuTe DSL kernels cannot run here, so the
# chunked gradient-in-forward autograd around them runs over liger_sm90.torch_primitives, the same
# four-kernel contract in torch (bf16 logits and dZ, fp32 softmax). What this holds: the chunking,
# the row padding, the shifted targets, the per-row dX scaling and the summed dW against the full
# fp32 logits. The kernels themselves are compared on the H200 (bench/loss_head.py).


def test_liger_sm90_chunked_path_matches_full_logits_in_loss_and_gradients(monkeypatch):
    from train.common import liger_sm90

    asked: list[str] = []  # the CE pass each --loss-impl asks for (liger-sm90-tce: the Triton one)
    monkeypatch.setattr(liger_sm90, "liger_primitives", lambda ce="liger": asked.append(ce) or liger_sm90.torch_primitives())
    monkeypatch.setattr(liger_sm90, "CHUNK_ROWS", 128)
    torch.manual_seed(0)
    # 3 x 70 positions: 210 rows, padded to 256 = two 128-row chunks
    hidden = (torch.randn(3, 70, 256) * 2).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(512, 256) * 0.05).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 512, (3, 70))
    labels[:, :5] = IGNORE_INDEX
    labels[2, 40:] = IGNORE_INDEX
    results = {}
    for impl in ("logits", "liger-sm90", "liger-sm90-tce"):
        hidden.grad = weight.grad = None
        per_token = token_losses(hidden.float() if impl == "logits" else hidden,
                                 weight.float() if impl == "logits" else weight, labels, impl)
        valid = labels[:, 1:] != IGNORE_INDEX
        (per_token.sum() / valid.sum()).backward()
        results[impl] = (per_token.detach(), hidden.grad.float(), weight.grad.float())
    assert asked == ["liger", "triton"]
    torch.testing.assert_close(results["liger-sm90-tce"], results["liger-sm90"], atol=0, rtol=0)
    (want, want_h, want_w), (got, got_h, got_w) = results["logits"], results["liger-sm90"]
    assert got.shape == (3, 69) and got.dtype == torch.float32 and torch.all(got[labels[:, 1:] == IGNORE_INDEX] == 0)
    # bf16 logits (8 bits of mantissa) against fp32 ones: the kernel's own rounding
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)
    for g, w in ((got_h, want_h), (got_w, want_w)):
        assert float((g - w).norm() / w.norm()) < 0.02


def test_liger_sm90_refuses_per_row_weights_and_bad_shapes(monkeypatch):
    from train.common import liger_sm90

    e = torch.randn(130, 256).to(torch.bfloat16).requires_grad_()
    c = (torch.randn(256, 256) * 0.05).to(torch.bfloat16)
    targets = torch.randint(0, 256, (130,))
    out = liger_sm90.linear_cross_entropy(e, c, targets, liger_sm90.torch_primitives())
    with pytest.raises(RuntimeError, match="weights differ between rows"):
        (out * torch.linspace(0.5, 1.5, 130)).sum().backward()
    with pytest.raises(LossImplError, match="vocab 300 is not a multiple of 256"):
        token_losses(torch.zeros(1, 4, 256, dtype=torch.bfloat16), torch.zeros(300, 256, dtype=torch.bfloat16),
                     torch.zeros(1, 4, dtype=torch.long), "liger-sm90")


# The CUTLASS DSL splits one `cutlass` package over three wheels under <site>/nvidia_cutlass_dsl/
# dsl_packages, which only the nvidia-cutlass-dsl wheel's nvidia_cutlass_dsl_packages.pth puts on
# sys.path. `pip install --target DIR` plus PYTHONPATH=DIR (bench/install_kernels.py) skips it: Python
# reads .pth files in site directories only, so `import cutlass` failed on the H200 with every wheel
# installed. The layout below is the wheels' (their .pth line verbatim), with an empty `cutlass`.
CUTLASS_PTH = ("import sys, os, nvidia_cutlass_dsl; "
               "sys.path.insert(0, os.path.join(nvidia_cutlass_dsl.__path__[0], 'dsl_packages'))\n")
PROBE = ("import train.common.liger_sm90 as m\n"
         "m.IMPORTS = (('cutlass', 'nvidia-cutlass-dsl-libs-core'), ('cutlass._mlir', 'nvidia-cutlass-dsl-libs-base'))\n"
         "print(m.import_problem())\n")


def test_liger_sm90_probe_names_the_cutlass_dsl_pth_that_pythonpath_skips(tmp_path):
    import importlib.util
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("install_kernels", repo / "bench" / "install_kernels.py")
    install_kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(install_kernels)
    site = tmp_path / "lossenv"
    packages = site / "nvidia_cutlass_dsl" / "dsl_packages"
    (packages / "cutlass").mkdir(parents=True)
    (packages / "cutlass" / "__init__.py").write_text("")

    def probe(pythonpath: str) -> str:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), pythonpath])}
        proc = subprocess.run([sys.executable, "-P", "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    # the libs without the meta wheel: no .pth at all
    assert probe(str(site)).startswith("nvidia-cutlass-dsl missing (its libs are in")
    (site / "nvidia_cutlass_dsl_packages.pth").write_text(CUTLASS_PTH)
    said = probe(str(site))
    assert said == (f"nvidia-cutlass-dsl is installed but its .pth file was not read (Python reads .pth files "
                    f"only in site directories, not from PYTHONPATH): add {packages} to PYTHONPATH"), said
    # what the bench puts on PYTHONPATH: the target and what its .pth adds (the .pth run as Python runs it)
    assert install_kernels.site_paths(site) == [str(packages)]
    # `cutlass` now imports; the next missing part is named by the wheel that ships it
    said = probe(install_kernels.pythonpath(site))
    assert said.startswith("nvidia-cutlass-dsl-libs-base missing or broken (import cutlass._mlir: "
                           "ModuleNotFoundError: No module named 'cutlass._mlir')"), said
    assert "\n" not in said
