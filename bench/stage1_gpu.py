"""Stage-1 full-step speed (fwd + bwd + optimizer) of the real trainer step, in variants.

Times `train.stage1.train.train_step` itself, with the trainer's own model build, kernel policy,
loss module and optimizer, on the `qwen35-2b` shape (or any model shape):

  naive         torch fallback (the project's reference GDN/conv kernels, as --allow-slow-path
                gives), padded batches of variable length, full logits, foreach AdamW
  fla-padded    fla + causal-conv1d, the same padded batches
  fla-packed    fla, uniform packed rows of --row-len tokens
  +cce          ... plus Cut Cross-Entropy (no full-vocab logits)
  +liger        ... plus Liger's fused linear cross-entropy instead
  fast          fla, packed, the fused loss the trainer picks by default, fused AdamW: what
                `launch submit stage1` runs on a GPU

The same documents (long-tailed lengths, 32..row_len tokens) feed every variant. tok/s counts
real (non-padding) tokens, so padded and packed variants compare useful work; MFU uses
train.common.mfu (torchtitan: 6*N_matmul + 12*L_full*h*d*row_len, 989 TFLOP/s peak) on those
tokens. `slow steps` counts timed steps over 3x the median: on variable shapes fla/Triton
re-autotune. Each variant appends one JSON line to --jsonl and prints a table row.
Every variant's AdamW keeps fp32 master weights of the bf16 parameters, as the trainer does since
the multi-GPU runs (train/common/master_weights.py); the issue-9 table in bench/RESULTS.md was
measured before that, with AdamW on the bf16 parameters (about 3% faster, and wrong).

    python bench/stage1_gpu.py --variants naive,fla-padded,fla-packed --jsonl out.jsonl
    python bench/stage1_gpu.py --variants fast --profile      # plus a torch.profiler summary
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from train.common import fastpath  # noqa: E402
from train.common.distributed import DistInfo  # noqa: E402
from train.common.losses import select_loss_impl  # noqa: E402
from train.common.metrics import compile_counts  # noqa: E402
from train.common.packing import Packer, collate  # noqa: E402
from train.stage1.model import build_model  # noqa: E402
from train.stage1.objective import CausalLMObjective  # noqa: E402
from train.stage1.train import Stage1Config, make_stepper, mfu_terms, train_step  # noqa: E402

ONE_RANK = DistInfo(0, 1, 0, "127.0.0.1", 0, "gloo", False)


@dataclass(frozen=True)
class Variant:
    name: str
    fast_kernels: bool
    packed: bool
    loss_impl: str  # logits | cce | liger | auto
    fused_adamw: bool


VARIANTS = {
    "naive": Variant("naive", False, False, "logits", False),
    "fla-padded": Variant("fla-padded", True, False, "logits", False),
    "fla-packed": Variant("fla-packed", True, True, "logits", False),
    "+cce": Variant("+cce", True, True, "cce", False),
    "+liger": Variant("+liger", True, True, "liger", False),
    "fast": Variant("fast", True, True, "auto", True),
    "fast-liger": Variant("fast-liger", True, True, "liger", True),
    "fast-logits": Variant("fast-logits", True, True, "logits", True),
}


def documents(vocab: int, row_len: int, n_tokens: int, seed: int) -> list[tuple[list[int], int]]:
    """Long-tailed document lengths (lognormal, median ~700), random token ids."""
    g = torch.Generator().manual_seed(seed)
    docs, total = [], 0
    while total < n_tokens:
        length = int(min(row_len, max(32, math.exp(6.55 + 0.9 * torch.randn(1, generator=g).item()))))
        docs.append((torch.randint(0, vocab, (length,), generator=g).tolist(), len(docs) % 5))
        total += length
    return docs


def packed_batches(docs, row_len: int, rows: int) -> list[dict]:
    packed = list(Packer(row_len=row_len).pack(docs))
    return [collate(packed[i:i + rows]) for i in range(0, len(packed) - rows + 1, rows)]


def padded_batches(docs, row_len: int, rows: int) -> list[dict]:
    """One document per row, right-padded to the batch's longest; about rows*row_len tokens a batch."""
    budget, out, i = rows * row_len, [], 0
    while i < len(docs):
        group = [docs[i]]
        i += 1
        while i < len(docs) and (len(group) + 1) * max(len(d[0]) for d in group + [docs[i]]) <= budget:
            group.append(docs[i])
            i += 1
        width = max(len(d[0]) for d in group)
        out.append(collate([next(iter(Packer(row_len=width).pack([d]))) for d in group]))
    return out


def run_variant(v: Variant, args: argparse.Namespace, device: torch.device) -> dict:
    cfg = Stage1Config(shape=args.shape, row_len=args.row_len, batch_rows=args.rows, lr=1e-4, warmup=1,
                       steps=10**6, loss_impl=v.loss_impl)
    torch.manual_seed(0)
    if v.fast_kernels:
        kernels = fastpath.select_kernels(device)
    else:  # the reference kernels, what --allow-slow-path falls back to (pure torch, fp32 inside)
        kernels = fastpath.select_kernels(torch.device("cpu"))
    model, spec = build_model(args.shape, device=device, dtype=torch.bfloat16)
    fastpath.install_kernels(model, kernels)
    loss_impl = select_loss_impl(device, v.loss_impl)
    objective = CausalLMObjective(model, loss_impl)
    stepper = make_stepper(objective, model, cfg, device, ONE_RANK, ds=False, fused=v.fused_adamw)
    model.train()
    docs = documents(spec.vocab.padded_vocab, args.row_len, (args.warmup + args.steps + 2) * args.rows * args.row_len,
                     seed=1)
    batches = (packed_batches if v.packed else padded_batches)(docs, args.row_len, args.rows)
    n = min(len(batches), args.warmup + args.steps)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, real_tokens, losses = [], [], []
    compiles0 = compile_counts()
    for i in range(n):
        b = batches[i]
        sync(device)
        t0 = time.perf_counter()
        losses.append(train_step(stepper, b, device).loss)  # syncs
        times.append(time.perf_counter() - t0)
        real_tokens.append(int((b["task_ids"] >= 0).sum()))
    compiles1 = compile_counts()
    timed = times[args.warmup:]
    tok_s = sum(real_tokens[args.warmup:]) / sum(timed)
    flops_per_token, peak, _ = mfu_terms(model, cfg, device)
    median = statistics.median(timed)
    row = {
        "variant": v.name, "kernels": kernels.header().splitlines()[0] if kernels.header() else "",
        "loss_impl": loss_impl, "fused_adamw": v.fused_adamw, "packed": v.packed, "tok_s": tok_s,
        "mfu": tok_s * flops_per_token / peak if peak else None,  # no MFU where the peak is unknown
        "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0,
        "first_step_s": times[0], "median_step_s": median, "timed_steps": len(timed),
        "slow_steps": sum(t > 3 * median for t in timed), "shapes": len({tuple(b["input_ids"].shape) for b in batches[:n]}),
        "recompiles": compiles1[1] - compiles0[1], "first_loss": losses[0], "last_loss": losses[-1],
        "params": spec.n_params, "vocab": spec.vocab.padded_vocab, "flops_per_token": flops_per_token,
        "row_len": args.row_len, "rows": args.rows,
    }
    if args.profile:
        row["profile"] = profile_steps(stepper, batches[:3], device)
    del objective, model, stepper
    free_memory(device)
    return row


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def profile_steps(stepper, batches, device, top: int = 15) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for b in batches:
            train_step(stepper, b, device)
        sync(device)
    events = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in prof.key_averages()) or 1.0
    rows = []
    for e in sorted(prof.key_averages(), key=lambda e: e.self_device_time_total, reverse=True)[:top]:
        rows.append({"op": e.key[:70], "self_cuda_ms": e.self_device_time_total / 1e3 / len(batches),
                     "share": e.self_device_time_total / total, "calls": e.count // len(batches)})
    del events
    return rows


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen35-2b", help="model shape (train/common/shapes.py)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--row-len", type=int, default=8192)
    p.add_argument("--rows", type=int, default=1, help="packed rows per step")
    p.add_argument("--steps", type=int, default=8, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--jsonl", default=None)
    p.add_argument("--cpu-smoke", action="store_true", help="run on CPU (tiny shape) to check the script itself")
    args = p.parse_args()
    if args.cpu_smoke:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda", 0)
    else:
        print("bench/stage1_gpu.py needs a CUDA GPU (or --cpu-smoke)", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# {name}  torch {torch.__version__}  shape {args.shape}  "
          f"row_len {args.row_len} x {args.rows}  TRITON_CACHE_DIR={os.environ.get('TRITON_CACHE_DIR', '~/.triton')}")
    print(f"{'variant':<11} {'loss':<6} {'tok/s':>8} {'MFU':>6} {'peak GiB':>8} {'1st step s':>10} "
          f"{'median s':>8} {'slow/steps':>10} {'shapes':>6}", flush=True)
    for name in args.variants.split(","):
        try:
            row = run_variant(VARIANTS[name], args, device)
        except Exception as exc:  # one failing variant must not hide the others' numbers
            row = {"variant": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            print(f"{name:<11} ERROR {row['error']}", flush=True)
            free_memory(device)
        else:
            print(f"{row['variant']:<11} {row['loss_impl']:<6} {row['tok_s']:>8,.0f} {row['mfu']:>6.1%} "
                  f"{row['peak_mem_gib']:>8.1f} {row['first_step_s']:>10.1f} {row['median_step_s']:>8.3f} "
                  f"{row['slow_steps']:>4}/{row['timed_steps']:<5} {row['shapes']:>6}", flush=True)
            for prow in row.get("profile", []):
                print(f"    {prow['op']:<70} {prow['self_cuda_ms']:>8.2f} ms {prow['share']:>6.1%} x{prow['calls']}")
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
