"""Stage-1 speed levers on one GPU, side by side in one process: the trainer's own step.

Each variant builds the trainer's model for its shape (the vocab comes from the shape's config,
train/common/shapes.py), installs the kernels the trainer would (`fastpath`), applies the levers the trainer's
flags name (`train.common.levers`: attention kernel, regional compile, activation
checkpointing), and times `train.stage1.train.train_step` (forward + loss + backward + clip +
AdamW with fp32 masters, the trainer's Stepper) on batches of the reference run's bimodal length mix: 3D samples of
5.8k-6.9k tokens (65%) and replay samples of 300-800 tokens (35%), packed as the data layer
packs them (`layout_packer`: a fresh packer per batch, its first rows). The same seed gives every
variant of a layout the same batches.

Levers (one variant each, all against `eager-2`, today's trainer):

  eager-2         compile off, sdpa (dense block-diagonal mask), 2 rows x 8192, first-fit rows
  compiled-2      + regional torch.compile                               (--compile on)
  compiled-4      + 4 rows a step                                        (--batch-rows 4)
  varlen-2        compiled, 2 rows, varlen attention instead of the mask (--attention varlen)
  flat-2          compiled, varlen, one 16k stream, whole documents      (--packing flat)
  flat-4          compiled, varlen, one 32k stream                       (the default path)
  flat-6          compiled, varlen, 48k stream                           (tokens by memory)
  flat-6-ckpt8    + activation checkpointing of 8 of the 24 layers       (--act-ckpt 8)
  conv-fla        flat-4 with fla's Triton conv instead of causal-conv1d (--conv-impl fla)
  gdn-noqla       flat-4 with fla's FlashQLA backend off (FLA_FLASH_QLA=0), when flash_qla is installed
  gdn-triton      flat-4 with fla's tilelang off (FLA_TILELANG=0): refused on Hopper + Triton < 3.7.1
  compiled-2-warm compiled-2 again after torch._dynamo.reset(): its first step is the warm-cache one
  eager-2-again   the baseline once more, for drift
  0.8b-flat-4     qwen35-0.8b with the chosen levers

Columns: tok/s (every token of the batch, padding included), useful tok/s (document tokens),
MFU on each (train/common/mfu.py: torchtitan's 6N + attention + gated-delta-rule terms, 989
TFLOP/s; the attention term uses the 8192-token document bound in every layout), peak GiB,
first step s (cold: the compile or kernel autotune it paid; see the -warm row), graphs compiled
in warm-up, recompiles during the timed steps (must be 0), packing efficiency, the share of 3D
samples among the batch's documents (the drawn mix is 0.65), tokens dropped (0: whole documents;
before issue 34, cut to fill dropped the tails of the documents that ended a stream).

    python bench/stage1_levers.py --out DIR                 # the full list (about 10 min warm)
    python bench/stage1_levers.py --out DIR --quick         # eager-2, compiled-2, flat-4, 0.8b-flat-4
    python bench/stage1_levers.py --out DIR --variants flat-4,conv-fla
    python bench/stage1_levers.py --out DIR --cpu-smoke --quick   # the script itself, tiny, on CPU
    python bench/stage1_levers.py --out DIR --packing-only        # the layouts' packing alone (CPU)

Results: a table on stdout and DIR/levers.jsonl (one line per variant, appended as each ends).
`--budget-s` stops starting variants once that much wall time has passed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from train.common import fastpath  # noqa: E402
from train.common.distributed import DistInfo  # noqa: E402
from train.common.levers import Levers, apply_levers  # noqa: E402
from train.common.losses import select_loss_impl  # noqa: E402
from train.common.metrics import compile_counts  # noqa: E402
from train.common.mfu import mfu_pair  # noqa: E402
from train.common.packing import collate, layout_packer, rows_per_batch  # noqa: E402
from train.stage1.model import build_model  # noqa: E402
from train.stage1.objective import CausalLMObjective  # noqa: E402
from train.stage1.train import Stage1Config, make_stepper, mfu_terms, train_step  # noqa: E402

ONE_RANK = DistInfo(0, 1, 0, "127.0.0.1", 0, "gloo", False)
P_3D = 0.652  # the reference run's share of 3D samples (880k of 1.35M)
TASKS_3D = (0, 1, 2)  # gen_img, gen_txt, und; replay_img, replay_text are 3, 4


@dataclass(frozen=True)
class Variant:
    name: str
    rows: int = 2
    packing: str = "rows"
    compile: str = "on"
    attention: str = "sdpa"
    act_ckpt: int = 0
    conv: str = "auto"
    shape: str | None = None  # None: --shape
    env: tuple[tuple[str, str], ...] = ()
    reset_first: bool = False  # torch._dynamo.reset() first (fresh in-memory compile state)


BASE = Variant("eager-2", compile="off")
FLAT4 = Variant("flat-4", rows=4, packing="flat", attention="varlen")
VARIANTS = {v.name: v for v in (
    BASE,
    Variant("compiled-2"),
    Variant("compiled-4", rows=4),
    Variant("varlen-2", attention="varlen"),
    Variant("flat-2", packing="flat", attention="varlen"),
    FLAT4,
    replace(FLAT4, name="flat-6", rows=6),
    replace(FLAT4, name="flat-6-ckpt8", rows=6, act_ckpt=8),
    replace(FLAT4, name="conv-fla", conv="fla"),
    replace(FLAT4, name="gdn-noqla", env=(("FLA_FLASH_QLA", "0"),)),
    replace(FLAT4, name="gdn-triton", env=(("FLA_TILELANG", "0"), ("FLA_FLASH_QLA", "0"))),
    Variant("compiled-2-warm", reset_first=True),
    replace(BASE, name="eager-2-again"),
    replace(FLAT4, name="0.8b-flat-4", shape="qwen35-0.8b"),
)}
QUICK = ("eager-2", "compiled-2", "flat-4", "0.8b-flat-4")


def bimodal_documents(vocab: int, row_len: int, seed: int):
    """Endless (tokens, task) draws of the reference mix, lengths scaled to ``row_len``."""
    g = torch.Generator().manual_seed(seed)
    lo3, hi3 = round(row_len * 5800 / 8192), round(row_len * 6900 / 8192)
    lo_r, hi_r = max(2, round(row_len * 300 / 8192)), max(3, round(row_len * 800 / 8192))
    while True:
        is_3d = torch.rand(1, generator=g).item() < P_3D
        n = int(torch.randint(lo3, hi3 + 1, (1,), generator=g)) if is_3d else int(
            torch.randint(lo_r, hi_r + 1, (1,), generator=g))
        task = int(torch.randint(0, 3, (1,), generator=g)) if is_3d else 3 + int(torch.randint(0, 2, (1,), generator=g))
        yield torch.randint(0, vocab, (n,), generator=g).tolist(), task


def make_batches(layout: str, rows: int, row_len: int, vocab: int, n: int) -> tuple[list[dict], dict[str, float]]:
    """``n`` batches as the data layer builds them, and the packing statistics over them."""
    out, real, total, dropped, n_3d, n_docs = [], 0, 0, 0, 0, 0
    for k in range(n):
        # as the data layer: a batch closes once no row has room for one more 3D asset (scaled like the lengths)
        packer = layout_packer(layout, row_len, rows, close_below=round(row_len * 5824 / 8192))
        got = []
        for row in packer.pack(bimodal_documents(vocab, row_len, seed=1000 + k)):
            got.append(row)
            if len(got) == rows_per_batch(layout, rows):
                break
        for row in got:
            starts = row.cu_seqlens[:-1].long()
            tasks = row.task_ids[starts[starts < row.n_real_tokens]]
            n_3d += int(sum((tasks == t).sum() for t in TASKS_3D))
            n_docs += tasks.numel()
            real += row.n_real_tokens
            total += row.input_ids.numel()
        dropped += packer.dropped_tokens
        out.append(collate(got))
    return out, {"packing_eff": real / total, "share_3d": n_3d / max(1, n_docs), "dropped": dropped / (real + dropped)}


def run_variant(v: Variant, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    shape = v.shape or args.shape
    if args.cpu_smoke:
        shape = "tiny"
    saved_env = {k: os.environ.get(k) for k, _ in v.env}
    os.environ.update(dict(v.env))
    try:
        if v.reset_first or args.reset_each:
            torch._dynamo.reset()
        return _run(v, shape, args, device)
    finally:
        for k, old in saved_env.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old


def _run(v: Variant, shape: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    cfg = Stage1Config(shape=shape, row_len=args.row_len, batch_rows=v.rows, lr=1e-4, warmup=1, steps=10**6)
    t_build = time.perf_counter()
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kernels = fastpath.select_kernels(device, conv=v.conv)
    model, spec = build_model(shape, device=device, dtype=dtype)
    notes = []
    try:
        fastpath.install_kernels(model, kernels)
    except fastpath.FastPathError as exc:
        if gdn_backend() != "flash_qla":
            raise
        # FlashQLA failed the bf16 check: say so, and measure the rest without it (this process)
        notes.append(f"flash_qla refused, FLA_FLASH_QLA=0 from here on: {str(exc)[:200]}")
        os.environ["FLA_FLASH_QLA"] = "0"
        fastpath.install_kernels(model, kernels)
    levers = Levers(compile=v.compile, attention=v.attention, act_ckpt=v.act_ckpt)
    lines = apply_levers(model, device, levers, backend=args.compile_backend)
    objective = CausalLMObjective(model, select_loss_impl(device, "auto"))
    stepper = make_stepper(objective, model, cfg, device, ONE_RANK, ds=False)
    model.train()
    n = args.warmup + args.steps
    batches, packing = make_batches(v.packing, v.rows, args.row_len, spec.vocab.padded_vocab, n)
    build_s = time.perf_counter() - t_build
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, all_tok, useful_tok, losses = [], [], [], []
    graphs0, recompiles0 = compile_counts()
    graphs_warm, recompiles_warm = graphs0, recompiles0
    for i, b in enumerate(batches):
        if i == args.warmup:
            graphs_warm, recompiles_warm = compile_counts()
        sync(device)
        t0 = time.perf_counter()
        losses.append(train_step(stepper, b, device).loss)  # syncs
        times.append(time.perf_counter() - t0)
        all_tok.append(b["input_ids"].numel())
        useful_tok.append(int(b["n_real_tokens"]))
    graphs1, recompiles1 = compile_counts()
    timed = times[args.warmup:]
    tok_s = sum(all_tok[args.warmup:]) / sum(timed)
    useful_s = sum(useful_tok[args.warmup:]) / sum(timed)
    flops_per_token, peak, _ = mfu_terms(model, cfg, device)
    # no MFU where the peak is unknown (the CPU smoke run)
    mfu_all, mfu_useful = mfu_pair(tok_s, useful_s, flops_per_token, 1, peak) if peak else (None, None)
    row = {
        "variant": v.name, "shape": shape, "rows": v.rows, "row_len": args.row_len, "packing": v.packing,
        "compile": v.compile, "attention": v.attention, "act_ckpt": v.act_ckpt, "env": dict(v.env),
        "kernels": kernels.header().splitlines()[0], "levers": lines, "gdn_backend": gdn_backend(), "notes": notes,
        "tok_s": tok_s, "useful_tok_s": useful_s, "mfu": mfu_all, "mfu_useful": mfu_useful,
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0,
        "build_s": build_s, "first_step_s": times[0], "median_step_s": statistics.median(timed),
        "timed_steps": len(timed), "graphs_warmup": graphs_warm - graphs0, "recompiles_warmup": recompiles_warm - recompiles0,
        "recompiles": (recompiles1 - recompiles_warm), "graphs_timed": graphs1 - graphs_warm,
        "first_loss": losses[0], "last_loss": losses[-1], "params": spec.n_params, "vocab": spec.vocab.padded_vocab,
        "flops_per_token": flops_per_token, "tokens_per_step": all_tok[0], **packing,
    }
    del objective, model, stepper, batches
    free_memory(device)
    return row


def gdn_backend() -> str:
    if find_spec("flash_qla") is not None and os.environ.get("FLA_FLASH_QLA", "1") != "0":
        return "flash_qla"
    if find_spec("tilelang") is not None and os.environ.get("FLA_TILELANG", "1") != "0":
        return "fla+tilelang"
    return "fla triton"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


HEADER = (f"{'variant':<16} {'gdn':<12} {'tok/step':>8} {'tok/s':>8} {'useful/s':>8} {'MFU':>6} {'uMFU':>6} {'peak GiB':>8} "
          f"{'1st s':>6} {'step s':>6} {'graphs':>6} {'recomp':>6} {'pack':>6} {'3D':>5} {'drop':>5} {'loss0':>6}")


def _pct(x: float | None) -> str:
    return f"{x:>6.1%}" if x is not None else f"{'-':>6}"


def format_row(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{r['variant']:<16} ERROR {r['error']}"
    return (f"{r['variant']:<16} {r['gdn_backend']:<12} {r['tokens_per_step']:>8} {r['tok_s']:>8,.0f} {r['useful_tok_s']:>8,.0f} "
            f"{_pct(r['mfu'])} {_pct(r['mfu_useful'])} {r['peak_gib']:>8.1f} {r['first_step_s']:>6.1f} "
            f"{r['median_step_s']:>6.3f} {r['graphs_warmup']:>6} {r['recompiles']:>6} {r['packing_eff']:>6.1%} "
            f"{r['share_3d']:>5.2f} {r['dropped']:>5.1%} {r['first_loss']:>6.3f}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for levers.jsonl")
    p.add_argument("--shape", default="qwen35-2b", help="model shape (train/common/shapes.py)")
    p.add_argument("--variants", default=None, help=f"comma-separated, from: {', '.join(VARIANTS)}")
    p.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}, 1 warm-up + 3 steps")
    p.add_argument("--row-len", type=int, default=None, help="tokens per row / longest document (8192)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per variant (default 5, quick 3)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per variant (default 2, quick 1)")
    p.add_argument("--budget-s", type=float, default=560.0, help="start no variant after this many seconds")
    p.add_argument("--reset-each", action="store_true", help="torch._dynamo.reset() before every variant")
    p.add_argument("--compile-backend", default=None, help="torch.compile backend (inductor; aot_eager on CPU)")
    p.add_argument("--cpu-smoke", action="store_true", help="run on CPU with the tiny shape, 256-token rows")
    p.add_argument("--packing-only", action="store_true", help="only the packing statistics of each layout (no model)")
    p.add_argument("--batches", type=int, default=100, help="batches per layout for --packing-only")
    a = p.parse_args(argv)
    names = a.variants.split(",") if a.variants else list(QUICK if a.quick else VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    a.names = names
    a.steps = a.steps or (3 if a.quick else 5)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.quick else 2)
    a.row_len = a.row_len or (256 if a.cpu_smoke else 8192)
    a.compile_backend = a.compile_backend or ("aot_eager" if a.cpu_smoke else "inductor")
    return a


def packing_table(args: argparse.Namespace, out: Path) -> int:
    """Useful-token share, 3D share and dropped tokens of each layout over --batches batches."""
    print(f"# packing of the bimodal mix (3D share drawn: {P_3D}), {args.batches} batches, row_len {args.row_len}")
    print(f"{'layout':<8} {'rows':>4} {'tok/step':>8} {'useful':>7} {'3D share':>8} {'dropped':>7}")
    for layout, rows in (("rows", 1), ("rows", 2), ("rows", 4), ("flat", 2), ("flat", 4), ("flat", 6)):
        _, stats = make_batches(layout, rows, args.row_len, 1000, args.batches)
        print(f"{layout:<8} {rows:>4} {rows * args.row_len:>8} {stats['packing_eff']:>7.1%} "
              f"{stats['share_3d']:>8.3f} {stats['dropped']:>7.1%}", flush=True)
        with open(out / "packing.jsonl", "a") as f:
            f.write(json.dumps({"layout": layout, "rows": rows, "row_len": args.row_len, **stats}) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.packing_only:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        return packing_table(args, Path(args.out))
    if args.cpu_smoke:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # tiny matmuls: more threads only contend on a small shared machine
    elif torch.cuda.is_available():
        device = torch.device("cuda", 0)
    else:
        print("bench/stage1_levers.py needs a CUDA GPU (or --cpu-smoke)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # Variants of other shapes add graphs to the same regions; stay far from dynamo's per-function
    # limit (8), past which it would fall back to eager without failing.
    for knob in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# {name}  torch {torch.__version__}  shape {args.shape}  row_len {args.row_len}  "
          f"warmup {args.warmup} + {args.steps} steps  gdn {gdn_backend()}  "
          f"TRITON_CACHE_DIR={os.environ.get('TRITON_CACHE_DIR', '-')}  "
          f"TORCHINDUCTOR_CACHE_DIR={os.environ.get('TORCHINDUCTOR_CACHE_DIR', '-')}", flush=True)
    print(HEADER, flush=True)
    t_start = time.monotonic()
    rows = []
    for vname in args.names:
        if time.monotonic() - t_start > args.budget_s:
            row = {"variant": vname, "error": f"skipped: --budget-s {args.budget_s:.0f} s spent"}
        else:
            try:
                row = run_variant(VARIANTS[vname], args, device)
            except Exception as exc:  # one failing variant (OOM, a refused kernel) must not hide the others
                row = {"variant": vname, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            free_memory(device)  # here, not in the except block: its traceback holds the variant's tensors
        row["device"] = name
        rows.append(row)
        print(format_row(row), flush=True)
        for note in row.get("notes", []):
            print(f"    note: {note}", flush=True)
        with open(out / "levers.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
    print(f"# {time.monotonic() - t_start:.0f} s; MFU convention: train/common/mfu.py; uMFU = useful-token MFU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
