"""Fast-path policy with kernels really absent or really broken at import time.

Stand-ins: this CPU machine cannot have fla, causal-conv1d, tilelang or a GPU. The tests put fake
packages on ``sys.path`` that are imported for real: broken ones raise at import exactly like a
missing ``libz3.so.4.15`` did on the H200; working ones wrap the project's reference kernels behind
fla's / causal-conv1d's call signatures, so the adapters' reshaping is checked against the oracle.
The GPU itself is replaced by passing ``capability``/``triton_version`` to ``select_kernels``.
"""

from __future__ import annotations

import copy
import importlib
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from train.common.fastpath import FastPathError, KernelChoice, install_kernels, select_kernels
from train.common.packing import Packer, collate, model_kwargs
from train.stage1.model import build_model

FAKE_ROOTS = ("fla", "causal_conv1d", "tilelang")
LIBZ3_ERROR = "libz3.so.4.15: cannot open shared object file: No such file or directory"

WORKING_FLA = {
    "fla/__init__.py": "",
    "fla/ops/__init__.py": "",
    "fla/ops/gated_delta_rule/__init__.py": """
        from train.common.reference_kernels import chunk_gated_delta_rule_varlen

        def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                   use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
            # fla's contract: varlen input is one flattened sequence with int64 offsets
            assert cu_seqlens is None or (q.shape[0] == 1 and cu_seqlens.dtype == __import__("torch").int64)
            out = chunk_gated_delta_rule_varlen(q, k, v, g, beta, cu_seqlens=cu_seqlens,
                                                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
            return out, None
    """,
    "fla/modules/__init__.py": "",
    "fla/modules/causal_conv1d/__init__.py": """
        from train.common.reference_kernels import causal_conv1d_varlen, cu_seqlens_to_seq_idx

        def causal_conv1d(x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False,
                          activation=None, backend="triton", cu_seqlens=None, **kwargs):
            # fla's layout: x is [B, T, D]; varlen needs B == 1
            b, t, d = x.shape
            seq_idx = None if cu_seqlens is None else cu_seqlens_to_seq_idx(cu_seqlens, b * t).view(b, t)
            out = causal_conv1d_varlen(x.transpose(1, 2), weight, bias, activation, seq_idx=seq_idx)
            return out.transpose(1, 2), None
    """,
    "fla/utils/__init__.py": "def has_usable_nvcc():\n    return True\n",
}
BROKEN = 'raise ImportError("' + LIBZ3_ERROR + '")\n'


def _forget_fakes() -> None:
    for name in list(sys.modules):
        if name.split(".")[0] in FAKE_ROOTS:
            del sys.modules[name]
    importlib.invalidate_caches()


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A directory on sys.path[0]; ``site(files)`` writes packages into it."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    _forget_fakes()

    def write(files: dict[str, str]) -> Path:
        for rel, text in files.items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(text))
        importlib.invalidate_caches()
        return root

    yield write
    _forget_fakes()


def test_cpu_uses_the_reference_kernels(capsys):
    choice = select_kernels("cpu")
    assert not choice.slow_path and "reference" in choice.gdr and "reference" in choice.conv
    assert "kernels[cpu]" in choice.header()
    assert capsys.readouterr().err == ""


def test_fla_absent_is_refused_with_the_real_exception(site):
    site({})  # nothing installed: the real ModuleNotFoundError
    with pytest.raises(FastPathError) as err:
        select_kernels("cuda", capability=(9, 0), triton_version="3.7.1")
    msg = str(err.value)
    assert "flash-linear-attention" in msg and "No module named 'fla'" in msg
    assert "causal conv" in msg and "No module named 'causal_conv1d'" in msg
    assert "--allow-slow-path" in msg


def test_fla_broken_at_import_names_the_hidden_error(site):
    site({"fla/__init__.py": BROKEN})
    with pytest.raises(FastPathError) as err:
        select_kernels("cuda", capability=(8, 0), triton_version="3.6.0")
    assert "flash-linear-attention is not usable" in str(err.value)
    assert "ImportError: " + LIBZ3_ERROR in str(err.value)


def test_conv_missing_while_fla_works_is_refused(site):
    files = {k: v for k, v in WORKING_FLA.items() if not k.startswith("fla/modules")}
    site(files)
    with pytest.raises(FastPathError, match="varlen causal conv") as err:
        select_kernels("cuda", capability=(8, 0), triton_version="3.6.0")
    assert "gated delta rule" not in str(err.value)


def test_allow_slow_path_is_loud_and_uses_the_reference(site, capsys):
    site({"fla/__init__.py": BROKEN})
    choice = select_kernels("cuda", allow_slow_path=True, capability=(9, 0), triton_version="3.7.1")
    assert choice.slow_path and "SLOW" in choice.gdr and "SLOW" in choice.conv
    err = capsys.readouterr().err
    assert "TRAINING ON THE SLOW PATH" in err and LIBZ3_ERROR in err
    assert "SLOW PATH" in choice.header()


def test_hopper_with_bad_triton_and_broken_tilelang_is_refused(site):
    site({**WORKING_FLA, **FLA_BACKENDS, **WORKING_QLA,
          "causal_conv1d/__init__.py": "def causal_conv1d_fn(*a, **k):\n    pass\n", "tilelang/__init__.py": BROKEN})
    with pytest.raises(FastPathError) as err:
        select_kernels("cuda", capability=(9, 0), triton_version="3.6.0")
    msg = str(err.value)
    assert "Hopper" in msg and "3.6.0" in msg and "import tilelang failed" in msg and "libz3" in msg
    # the same stack is fine off Hopper, with a fixed triton, or once tilelang imports
    assert not select_kernels("cuda", capability=(8, 0), triton_version="3.6.0").slow_path
    assert not select_kernels("cuda", capability=(9, 0), triton_version="3.7.1").slow_path
    assert not select_kernels("cuda", capability=(9, 0), triton_version="3.3.1").slow_path


def test_hopper_with_bad_triton_and_working_tilelang_is_accepted(site):
    site({**WORKING_FLA, **FLA_BACKENDS, **WORKING_QLA, "tilelang/__init__.py": ""})
    choice = select_kernels("cuda", capability=(9, 0), triton_version="3.6.0")
    assert not choice.slow_path and choice.gdr.startswith("fla.")


def test_prefers_causal_conv1d_and_falls_back_to_fla_triton_conv(site):
    site(WORKING_FLA)
    choice = select_kernels("cuda", capability=(8, 0), triton_version="3.6.0")
    assert choice.conv.startswith("fla.modules.causal_conv1d")
    site({"causal_conv1d/__init__.py": "def causal_conv1d_fn(*a, **k):\n    pass\n"})
    assert select_kernels("cuda", capability=(8, 0), triton_version="3.6.0").conv.startswith("causal_conv1d.")


def test_fla_adapters_keep_documents_apart(site):
    """The fla adapters (batch flattened to one varlen sequence, fla's [B, T, D] conv layout) give
    the same logits as the reference kernels on a packed batch of two rows."""
    site(WORKING_FLA)
    fla_choice = select_kernels("cuda", capability=(8, 0), triton_version="3.6.0")
    torch.manual_seed(0)
    reference, _ = build_model("tiny")
    via_fla = copy.deepcopy(reference)
    install_kernels(reference, select_kernels("cpu"))
    install_kernels(via_fla, fla_choice)
    g = torch.Generator().manual_seed(5)
    docs = [(torch.randint(1, 4000, (n,), generator=g).tolist(), 0) for n in (50, 90, 70, 30)]
    batch = collate(list(Packer(row_len=128).pack(docs)))
    assert batch["input_ids"].shape[0] == 2
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            a = reference(**model_kwargs(batch)).logits
            b = via_fla(**model_kwargs(batch)).logits
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def _with_gdr_body(body: str) -> dict[str, str]:
    files = dict(WORKING_FLA)
    files["fla/ops/gated_delta_rule/__init__.py"] = body
    return files


def test_first_call_failure_is_caught_before_training(site):
    """Imports fine, fails when run (a Triton without a C compiler, fla's Hopper guard...)."""
    site(_with_gdr_body("""
        def chunk_gated_delta_rule(*args, **kwargs):
            raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")
    """))
    choice = select_kernels("cuda", capability=(8, 0), triton_version="3.6.0")
    model, _ = build_model("tiny")
    with pytest.raises(FastPathError, match="gated delta rule kernel fla.* failed its first call: RuntimeError: Failed to find C"):
        install_kernels(model, choice)


def test_a_kernel_that_leaks_across_documents_is_refused(site):
    """A gated-delta-rule kernel that ignores cu_seqlens (state flows from one document into the
    next, what a non-varlen kernel does to packed rows) disagrees with the reference."""
    site(_with_gdr_body("""
        from train.common.reference_kernels import chunk_gated_delta_rule_varlen

        def chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
            return chunk_gated_delta_rule_varlen(q, k, v, g, beta, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel), None
    """))
    choice = select_kernels("cuda", capability=(8, 0), triton_version="3.6.0")
    model, _ = build_model("tiny")
    with pytest.raises(FastPathError, match="disagrees with the varlen reference"):
        install_kernels(model, choice)
    assert install_kernels(model, choice, verify=False) == 3  # the check is what stops it


def test_install_kernels_refuses_a_model_without_gdn_layers():
    with pytest.raises(ValueError, match="no Qwen3.5 gated-delta-net"):
        install_kernels(torch.nn.Linear(2, 2), KernelChoice("cpu", "x", "y", "z", False))


def test_conv_choice_is_explicit_when_asked(site):
    site({**WORKING_FLA, "causal_conv1d/__init__.py": "def causal_conv1d_fn(*a, **k):\n    pass\n"})
    gpu = {"capability": (8, 0), "triton_version": "3.6.0"}
    assert select_kernels("cuda", **gpu).conv.startswith("causal_conv1d.")
    assert select_kernels("cuda", conv="fla", **gpu).conv.startswith("fla.modules.causal_conv1d")
    assert select_kernels("cuda", conv="causal-conv1d", **gpu).conv.startswith("causal_conv1d.")
    with pytest.raises(ValueError, match="unknown conv"):
        select_kernels("cuda", conv="cudnn", **gpu)


def test_conv_fla_only_is_refused_without_fla_conv(site):
    files = dict(WORKING_FLA)
    files["fla/modules/causal_conv1d/__init__.py"] = BROKEN
    site({**files, "causal_conv1d/__init__.py": "def causal_conv1d_fn(*a, **k):\n    pass\n"})
    with pytest.raises(FastPathError, match="varlen causal conv"):
        select_kernels("cuda", conv="fla", capability=(8, 0), triton_version="3.6.0")


def test_a_bf16_only_backend_is_checked_too(site):
    """fla dispatches by dtype (FlashQLA takes bf16 only): a backend that is right in fp32 and
    leaks across documents in bf16, the training dtype, is refused as well."""
    site(_with_gdr_body("""
        import torch
        from train.common.reference_kernels import chunk_gated_delta_rule_varlen

        def chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
            if q.dtype == torch.bfloat16:
                cu_seqlens = None
            return chunk_gated_delta_rule_varlen(q, k, v, g, beta, cu_seqlens=cu_seqlens,
                                                 use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel), None
    """))
    choice = select_kernels("cuda", capability=(8, 0), triton_version="3.6.0")
    model, _ = build_model("tiny")
    with pytest.raises(FastPathError, match=r"gated delta rule \(bf16\) kernel .* disagrees"):
        install_kernels(model, choice)


# fla 0.6's backend registry, as far as gdn_backend reads it: the first registered backend whose
# package is found and whose env switch is not "0" (fla/backends.py BackendRegistry.get_active);
# FlashQLA (package flash_qla, FLA_FLASH_QLA) is the one registered for gated_delta_rule on NVIDIA.
# Not modelled: per-call verification (FlashQLA takes K = V = 128 heads only, the Qwen3.5 shapes').
WORKING_QLA = {"flash_qla/__init__.py": ""}
FLA_BACKENDS = {
    "fla/backends.py": """
        import importlib.util, os

        class _FlashQLA:
            backend_type = "flash_qla"

            def usable(self):
                return importlib.util.find_spec("flash_qla") is not None and os.environ.get("FLA_FLASH_QLA", "1") != "0"

        class _Registry:
            def get_active(self):
                return next((b for b in (_FlashQLA(),) if b.usable()), None)

        def _load_operation_registry(operation):
            return _Registry()
    """,
}


def test_the_header_names_the_gdn_backend(site, monkeypatch):
    site({**WORKING_FLA, **FLA_BACKENDS, "tilelang/__init__.py": ""})
    choice = select_kernels("cuda", capability=(9, 0), triton_version="3.6.0", allow_slow_path=True)
    assert "[backend: triton (tilelang gated backward); flash-qla not installed" in choice.header()
    site({"flash_qla/__init__.py": ""})
    assert "gated-delta-rule=fla.ops.gated_delta_rule.chunk_gated_delta_rule [backend: flash_qla (FlashQLA" in \
        select_kernels("cuda", capability=(9, 0), triton_version="3.6.0").header()
    monkeypatch.setenv("FLA_FLASH_QLA", "0")
    assert "[backend: triton (tilelang" in select_kernels("cuda", capability=(9, 0), triton_version="3.6.0").gdr


def test_warm_up_runs_each_document_layout_through_the_chosen_kernels(site):
    """warm_kernels: fwd + bwd of the chosen GDN and conv kernels at the model's head shapes, one
    call per layout of warm_layouts (full-length, short and mixed documents), the model untouched."""
    import dataclasses

    from train.common.fastpath import warm_kernels, warm_layouts

    site(WORKING_FLA)
    choice = select_kernels("cuda", capability=(8, 0), triton_version="3.6.0")
    seen: list[list[int]] = []

    def recording(q, k, v, g, beta, cu_seqlens=None, **kw):
        seen.append(cu_seqlens.tolist())
        return choice.gdr_fn(q, k, v, g, beta, cu_seqlens=cu_seqlens, **kw)

    model, _ = build_model("tiny")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    traced = dataclasses.replace(choice, gdr_fn=recording)
    assert warm_kernels(model, traced, stream_len=512, max_doc=256, dtype=torch.float32) == 2
    assert seen == [[0, 256, 512], [0, 255, 256, 384, 512]]  # full/short coincide at 256: one call
    assert all(torch.equal(p, before[n]) and p.grad is None for n, p in model.named_parameters())
    layouts = warm_layouts(32768, 8192)
    assert [len(lay) for lay in layouts] == [4, 128, 8] and all(sum(lay) == 32768 for lay in layouts)
    assert warm_kernels(model, select_kernels("cpu"), 512, 256) == 0  # nothing to compile on the CPU


def test_tilelang_cache_goes_beside_the_node_local_triton_cache():
    from train.common.fastpath import configure_tilelang_cache

    env = {"TRITON_CACHE_DIR": "/scratch/cache/alice/triton/"}
    assert configure_tilelang_cache(env) == "/scratch/cache/alice/tilelang" == env["TILELANG_CACHE_DIR"]
    assert configure_tilelang_cache({"TRITON_CACHE_DIR": "/a/triton", "TILELANG_CACHE_DIR": "/b/tl"}) == "/b/tl"
    assert configure_tilelang_cache({}) is None


# ---------------------------------------------------------------------------------------------
# No silent slow path: the job's whole kernel set at the selection layer, with device "cuda" as
# data. The probes are the real ones: cut_cross_entropy, liger_kernel and flash_qla are really
# not installed on this machine, so `import cut_cross_entropy` really fails; fla is the stand-in
# package above where a test needs the GDN pieces present.

REPO = Path(__file__).resolve().parents[1]


def test_a_cuda_start_without_a_fused_loss_is_refused_in_one_line():
    """The DFlash drafter's set (its loss only) and stage-1's loss: `auto` on CUDA finds no fused
    kernel -> one line naming the package, the real import error and the install at the lock's pin."""
    with pytest.raises(FastPathError) as err:
        select_kernels("cuda", loss="auto", gdn=False)
    msg = str(err.value)
    assert "\n" not in msg
    assert "loss: cut-cross-entropy does not import" in msg
    assert "No module named 'cut_cross_entropy'" in msg
    assert "install: pip install 'cut-cross-entropy==25.1.1'" in msg and "--allow-slow-path" in msg


def test_allow_slow_path_names_the_loss_fallback_and_its_cost(capsys):
    choice = select_kernels("cuda", allow_slow_path=True, loss="auto", gdn=False)
    assert choice.loss_impl == "logits" and choice.slow_path
    header = choice.header()
    assert "loss=logits" in header and "SLOW PATH (--allow-slow-path), 1 fallback(s)" in header
    assert "loss: full logits over the vocab" in header and "~5% slower" in header and "1.7x the peak memory" in header
    assert "TRAINING ON THE SLOW PATH" in capsys.readouterr().err


def test_explicit_choices_are_not_fallbacks():
    """`--loss-impl logits` and `--attention sdpa` are what the job asked for: no refusal."""
    choice = select_kernels("cuda", loss="logits", attention="sdpa", gdn=False)
    assert not choice.slow_path and choice.loss_impl == "logits" and choice.attention_impl == "sdpa"
    cpu = select_kernels("cpu", loss="auto", attention="auto")
    assert cpu.loss_impl == "logits" and cpu.attention_impl == "sdpa" and not cpu.slow_path


def test_stage1_set_on_hopper_names_every_missing_piece_in_one_line(site, monkeypatch):
    """fla present, flash-qla, the fused loss and torch's varlen attention not: one line naming
    each, each with its install command. torch without torch.nn.attention.varlen (older than 2.10)
    is made by hiding that module from the import system, so its probe fails for real."""
    site({**WORKING_FLA, **FLA_BACKENDS, "tilelang/__init__.py": ""})
    monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", None)
    with pytest.raises(FastPathError) as err:
        select_kernels("cuda", capability=(9, 0), triton_version="3.7.1", loss="auto", attention="auto")
    msg = str(err.value)
    assert "\n" not in msg
    assert "gated-delta-rule backend: flash-qla does not import (ModuleNotFoundError: No module named 'flash_qla')" in msg
    assert "pip install 'flash-qla==0.1.3' 'tilelang==0.1.15' 'z3-solver==4.15.4.0'" in msg
    assert "loss: cut-cross-entropy does not import" in msg
    assert "attention: torch.nn.attention.varlen.varlen_attn" in msg and "pip install 'torch>=2.10'" in msg
    choice = select_kernels("cuda", allow_slow_path=True, capability=(9, 0), triton_version="3.7.1", loss="auto",
                            attention="auto")
    assert [f.piece for f in choice.fallbacks] == ["gated-delta-rule backend", "loss", "attention"]
    assert "49.7% MFU against 52.2% with FlashQLA" in choice.header()
    assert choice.gdr.startswith("fla.")  # the fallback is fla's Triton, not the reference kernel
    # FlashQLA off on purpose, off Hopper/Blackwell, or installed: no backend fallback
    assert not select_kernels("cuda", capability=(8, 0), triton_version="3.7.1").slow_path
    monkeypatch.setenv("FLA_FLASH_QLA", "0")
    assert not select_kernels("cuda", capability=(9, 0), triton_version="3.7.1").slow_path


def test_the_install_pins_are_the_gpu_locks_pins():
    from train.common.fastpath import LOCK_PINS

    for lock in ("requirements-gpu.lock", "requirements-gpu-cp312.lock"):
        pins = {}
        for line in (REPO / "images" / "trainer" / lock).read_text().splitlines():
            name, sep, rest = line.partition("==")
            if sep and not line.startswith("#"):
                pins[name.strip().lower()] = rest.split()[0]
        assert {d: pins.get(d) for d in LOCK_PINS} == LOCK_PINS, lock
