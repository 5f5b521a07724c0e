"""The stage-1 loss head side by side: each `--loss-impl` against full fp32 logits, in one process.

For the lm_head of a model shape (qwen35-2b: hidden 2048, padded vocab 273,152) and one step's
rows (4 x 8,192 tokens), each implementation of train.common.losses.token_losses runs the
trainer's loss (sum of the per-token losses / the number of targets) forward and backward on the
same bf16 hidden states, lm_head weight and labels (~8% ignored, as packing masks them):

  logits       full logits (bf16 GEMM, fp32 cross-entropy): the fallback
  cce          cut-cross-entropy (the default on CUDA)
  liger        Liger-Kernel's fused linear cross-entropy (its generic path)
  liger-sm90   Liger-Kernel's Hopper CuTe DSL kernel, chunked (train/common/liger_sm90.py)
  liger-sm90-tce  the same GEMMs with a Triton CE pass (Liger's own falls back to one value per
               thread per load above a 131,072 vocab)

Per implementation: the median fwd+bwd wall time over --iters (after --warmup; each iteration ends
in a device sync), its TFLOP/s (6*N*D*V),
the peak memory above the inputs, and its error against the reference: the same bf16 operands
with products, softmax and gradients in fp32 (chunks of rows). The verdict `ok` means the loss
per token within 0.05 + 2% and both gradients within 2% (relative norm) of it: bf16 tolerance
(8 mantissa bits on the logits). With --against IMPL (the bench uses cce, the default kernel)
every other implementation is also held to that one's own per-token loss and gradients, within
twice those tolerances (each side within them of fp32): a kernel that agrees with fp32 but not
with the trainer's default, or the reverse, shows in the `vs` column. A kernel that does not
import or fails prints its error in its row (liger-sm90's names the missing package).

    python3 bench/loss_head.py --jsonl out.jsonl
    python3 bench/loss_head.py --impls cce,liger-sm90 --against cce --rows 2 --iters 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from train.common.codebooks import CodebookVocab  # noqa: E402
from train.common.losses import select_loss_impl, token_losses  # noqa: E402
from train.common.packing import IGNORE_INDEX  # noqa: E402
from train.common.shapes import get_shape  # noqa: E402

TOL_LOSS_ABS, TOL_LOSS_REL, TOL_GRAD = 0.05, 0.02, 0.02
# Two implementations each within the tolerances above of fp32 are within twice them of each other.
PAIR = 2


def make_inputs(rows: int, row_len: int, hidden: int, vocab: int, device: torch.device, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    h = torch.randn(rows, row_len, hidden, generator=g).to(device, torch.bfloat16)  # RMSNorm'd: unit scale
    w = (torch.randn(vocab, hidden, generator=g) * 0.02).to(device, torch.bfloat16)
    labels = torch.randint(0, vocab, (rows, row_len), generator=g)
    labels[torch.rand(rows, row_len, generator=g) < 0.08] = IGNORE_INDEX
    return h, w, labels.to(device)


def reference(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, chunk: int = 2048):
    """Per-token loss [B, T-1] and the gradients of sum/count w.r.t. h and w, all in fp32."""
    rows, seq, dim = h.shape
    e = h[:, :-1].reshape(-1, dim)
    t = labels[:, 1:].reshape(-1)
    valid = t != IGNORE_INDEX
    count = valid.sum().clamp(min=1).float()
    wf = w.float()
    loss = torch.empty(e.shape[0], device=h.device)
    grad_e = torch.empty(e.shape[0], dim, device=h.device)
    grad_w = torch.zeros_like(wf)
    for lo in range(0, e.shape[0], chunk):
        x, tt, v = e[lo:lo + chunk].float(), t[lo:lo + chunk], valid[lo:lo + chunk]
        logits = x @ wf.t()
        loss[lo:lo + chunk] = F.cross_entropy(logits, tt, ignore_index=IGNORE_INDEX, reduction="none")
        p = torch.softmax(logits, dim=-1)
        del logits
        p[torch.arange(p.shape[0], device=p.device)[v], tt[v]] -= 1
        p *= (v.float() / count)[:, None]
        grad_e[lo:lo + chunk] = p @ wf
        grad_w += p.t() @ x
        del p
    grad_h = torch.zeros(rows, seq, dim, device=h.device)
    grad_h[:, :-1] = grad_e.view(rows, seq - 1, dim)
    return loss.view(rows, seq - 1), grad_h, grad_w


def compare(got: tuple, want: tuple, labels: torch.Tensor, scale: float = 1) -> dict:
    """Per-token loss and the two gradients of `got` against `want` (each (loss [B, T-1], grad h,
    grad w)): max loss difference, relative gradient norms, and whether they are within `scale`
    times the bf16 tolerances (targets only: ignored positions are 0 in every implementation)."""
    (loss, gh, gw), (ref_loss, ref_gh, ref_gw) = got, want
    ref_loss = ref_loss.float()
    err = (loss.float() - ref_loss).abs()
    out = {
        "loss_max_abs_err": float(err.max()),
        "loss_within": bool((err <= scale * (TOL_LOSS_ABS + TOL_LOSS_REL * ref_loss.abs())).all()),
        "grad_h_rel": float((gh.float() - ref_gh.float()).norm() / ref_gh.float().norm()),
        "grad_w_rel": float((gw.float() - ref_gw.float()).norm() / ref_gw.float().norm()),
    }
    out["ok"] = out["loss_within"] and max(out["grad_h_rel"], out["grad_w_rel"]) < scale * TOL_GRAD
    return out


def run_impl(impl: str, h, w, labels, ref, warmup: int, iters: int, keep: dict | None = None,
             against: tuple | None = None) -> dict:
    """One implementation's row; its (loss, grad h, grad w) go into `keep` when given (the
    --against baseline), and are compared with `against` when given."""
    device = h.device
    row: dict = {"impl": impl}
    try:
        select_loss_impl(device, impl)
    except Exception as exc:  # not importable here: say why in its row
        return {**row, "error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"}
    hh = h.detach().clone().requires_grad_()
    ww = w.detach().clone().requires_grad_()
    count = (labels[:, 1:] != IGNORE_INDEX).sum().clamp(min=1)
    times = []
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    base = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        for i in range(warmup + iters):
            hh.grad = ww.grad = None
            t0 = time.perf_counter()
            per_token = token_losses(hh, ww, labels, impl)
            (per_token.sum() / count).backward()
            sync()
            if i == 0:
                row["first_s"] = time.perf_counter() - t0  # includes JIT compiles
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    except Exception as exc:
        return {**row, "error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"}
    got = (per_token.detach().float(), hh.grad, ww.grad)
    row.update({
        "s": statistics.median(times),
        "peak_extra_gib": (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else float("nan"),
        "loss": float(got[0].sum() / count), "ref_loss": float(ref[0].sum() / count),
        **compare(got, ref, labels),
    })
    if against is not None:
        row["vs"] = compare(got, against, labels, scale=PAIR)
    if keep is not None:
        keep["result"] = got
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--impls", default="cce,liger-sm90,liger-sm90-tce,liger,logits")
    p.add_argument("--against", default="", metavar="IMPL",
                   help="also compare every other implementation with this one's loss and gradients (run first)")
    p.add_argument("--preset", default="qwen35-2b", help="model shape: hidden size and padded vocab")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--row-len", type=int, default=8192)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--jsonl", type=Path)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (the fused kernels need CUDA)")
    a = p.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print("loss_head: needs a CUDA GPU (or --device cpu for a smoke run)", file=sys.stderr)
        return 2
    device = torch.device(a.device)
    shape = get_shape(a.preset)
    vocab = CodebookVocab(shape.base_vocab, shape.codebooks).padded_vocab
    h, w, labels = make_inputs(a.rows, a.row_len, shape.hidden_size, vocab, device)
    n = a.rows * (a.row_len - 1)
    flop = 6 * n * shape.hidden_size * vocab
    print(f"# loss head: {a.rows} x {a.row_len} rows, hidden {shape.hidden_size}, vocab {vocab}, "
          f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}", flush=True)
    ref = reference(h, w, labels)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    impls = a.impls.split(",")
    if a.against:
        if a.against not in impls:
            print(f"loss_head: --against {a.against} is not one of --impls {a.impls}", file=sys.stderr)
            return 2
        impls = [a.against, *(i for i in impls if i != a.against)]
    rows, baseline = [], {}
    for impl in impls:
        row = run_impl(impl, h, w, labels, ref, a.warmup, a.iters, keep=baseline if impl == a.against else None,
                       against=baseline.get("result") if impl != a.against else None)
        if impl == a.against:
            row["baseline"] = True
        row.update({"rows": a.rows, "row_len": a.row_len, "hidden": shape.hidden_size, "vocab": vocab})
        if "s" in row:
            row["tflops"] = flop / row["s"] / 1e12
        rows.append(row)
        print(json.dumps(row), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if a.jsonl:
            with a.jsonl.open("a") as f:
                f.write(json.dumps(row) + "\n")
    fastest = min((r["s"] for r in rows if "s" in r), default=None)
    versus = f"vs {a.against}" if a.against else ""
    width = max(11, *(len(r["impl"]) for r in rows))
    print(f"\n{'impl':<{width}} {'fwd+bwd ms':>10} {'vs best':>7} {'TFLOP/s':>8} {'peak+ GiB':>9} {'1st s':>6} "
          f"{'loss':>8} {'max|dloss|':>10} {'grad h':>7} {'grad w':>7}  verdict"
          + (f"  | {versus}: {'max|dloss|':>10} {'grad h':>7} {'grad w':>7}  verdict" if versus else ""))
    for r in rows:
        if "error" in r:
            print(f"{r['impl']:<{width}} {'-':>10}  {r['error']}")
            continue
        line = (f"{r['impl']:<{width}} {r['s'] * 1e3:>10.1f} {r['s'] / fastest:>6.2f}x {r['tflops']:>8.0f} "
                f"{r['peak_extra_gib']:>9.1f} {r['first_s']:>6.1f} {r['loss']:>8.4f} {r['loss_max_abs_err']:>10.4f} "
                f"{r['grad_h_rel']:>7.2%} {r['grad_w_rel']:>7.2%}  {'ok' if r['ok'] else 'OUT OF TOLERANCE'}")
        if "vs" in r:
            v = r["vs"]
            line += (f"  | {' ' * len(versus)}  {v['loss_max_abs_err']:>10.4f} {v['grad_h_rel']:>7.2%} "
                     f"{v['grad_w_rel']:>7.2%}  {'ok' if v['ok'] else 'OUT OF TOLERANCE'}")
        elif versus:
            line += f"  | {'(the baseline)' if r.get('baseline') else '(no baseline: it failed)'}"
        print(line)
    print(f"(reference: fp32 products of the same bf16 operands; loss {rows[0].get('ref_loss', float('nan')):.4f}; "
          f"tolerance: loss {TOL_LOSS_ABS} + {TOL_LOSS_REL:.0%}, gradients {TOL_GRAD:.0%} relative norm"
          + (f"; against {a.against}: {PAIR}x that)" if versus else ")"))
    return 0 if all(r.get("ok", False) and r.get("vs", {"ok": True})["ok"] for r in rows if "error" not in r) else 1


if __name__ == "__main__":
    sys.exit(main())
