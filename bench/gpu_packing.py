"""GPU checks for the packed fast path (run on an H200 with fla; also runs on CPU as a smoke test).

    python bench/gpu_packing.py equivalence [--preset tiny] [--row-len 2048]
        fla's packed output vs (a) the same documents run one at a time through fla and (b) the
        project's reference kernels on the same packed batch; fp32 and bf16; logits, loss, grads.
    python bench/gpu_packing.py step [--preset qwen35-2b] [--row-len 8192] [--steps 5]
        fwd+bwd(+AdamW) steps of one packed row on the selected kernels: first-step time (compile),
        steady tok/s and MFU (train.common.mfu convention).
    python bench/gpu_packing.py refuse
        fla made unimportable (sys.modules['fla'] = None, in a subprocess): the policy must refuse.

Prints a table per check; exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import copy
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from train.common import mfu  # noqa: E402
from train.common.fastpath import FastPathError, install_kernels, select_kernels  # noqa: E402
from train.common.packing import Packer, collate, model_kwargs  # noqa: E402
from train.stage1.model import build_model  # noqa: E402


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_batch(vocab: int, row_len: int, rows: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Documents of mixed lengths (one longer than a row, so it is split) packed into ``rows`` rows."""
    g = torch.Generator().manual_seed(seed)
    lengths = [row_len + row_len // 3] + torch.randint(16, max(17, row_len // 2), (64,), generator=g).tolist()
    docs = [(torch.randint(1, vocab, (n,), generator=g).tolist(), i % 5) for i, n in enumerate(lengths)]
    packed = list(Packer(row_len=row_len).pack(docs))[:rows]
    return collate(packed)


def to_dev(batch, dev):
    return {k: v.to(dev) if torch.is_tensor(v) else v for k, v in model_kwargs(batch).items()}


def segments(batch):
    cu = batch["cu_seqlens"].tolist()
    row_len = batch["input_ids"].shape[1]
    n_real = [int((r != -1).sum()) for r in batch["task_ids"]]
    for a, b in zip(cu[:-1], cu[1:], strict=True):
        r = a // row_len
        if a - r * row_len < n_real[r]:
            yield r, a - r * row_len, b - r * row_len


def equivalence(args) -> bool:
    dev = device()
    choice = select_kernels(dev, allow_slow_path=args.allow_slow_path)
    print(choice.header())
    ok = True
    rows = []
    for dtype, atol in ((torch.float32, 2e-3), (torch.bfloat16, 5e-2)):
        torch.manual_seed(0)
        fast, spec = build_model(args.preset, device=dev, dtype=dtype)
        ref = copy.deepcopy(fast)
        install_kernels(fast, choice)
        install_kernels(ref, select_kernels("cpu"))  # the reference kernels, run on `dev`
        batch = make_batch(spec.vocab.base_vocab, args.row_len, rows=2)
        kw = to_dev(batch, dev)
        out_fast = fast(**kw)
        out_ref = ref(**kw)
        out_fast.loss.backward()
        out_ref.loss.backward()
        d_ref = (out_fast.logits.float() - out_ref.logits.float()).abs().max().item()
        d_loss = abs(out_fast.loss.item() - out_ref.loss.item())
        grad_rel = max(
            ((p.grad.float() - q.grad.float()).norm() / (q.grad.float().norm() + 1e-12)).item()
            for p, q in zip(fast.parameters(), ref.parameters(), strict=True)
            if p.grad is not None
        )
        d_alone = 0.0
        with torch.no_grad():
            for r, a, b in segments(batch):
                ids = kw["input_ids"][r : r + 1, a:b]
                alone = fast(input_ids=ids).logits.float()
                d_alone = max(d_alone, (out_fast.logits[r : r + 1, a:b].float() - alone).abs().max().item())
        passed = d_ref < atol and d_alone < atol and d_loss < atol and grad_rel < (2e-2 if dtype == torch.float32 else 1e-1)
        ok &= passed
        rows.append((str(dtype).split(".")[-1], d_alone, d_ref, d_loss, grad_rel, "PASS" if passed else "FAIL"))
        del fast, ref
    print(f"\n{'dtype':9} {'max|packed-alone|':>18} {'max|fast-ref|':>14} {'|dloss|':>10} {'max grad rel':>13}  result")
    for name, d_alone, d_ref, d_loss, g_rel, res in rows:
        print(f"{name:9} {d_alone:18.3e} {d_ref:14.3e} {d_loss:10.3e} {g_rel:13.3e}  {res}")
    return ok


def step(args) -> bool:
    dev = device()
    choice = select_kernels(dev, allow_slow_path=args.allow_slow_path)
    print(choice.header())
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model, spec = build_model(args.preset, device=dev, dtype=dtype)
    install_kernels(model, choice)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda")
    batch = make_batch(spec.vocab.base_vocab, args.row_len, rows=args.rows)
    kw = to_dev(batch, dev)
    tokens = batch["input_ids"].numel()
    per_token = mfu.flops_per_token(model.config, args.row_len)
    peak = mfu.peak_flops(torch.cuda.get_device_name(dev)) if dev.type == "cuda" else None
    times = []
    for _ in range(args.steps):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(**kw).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    steady = sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else times[0]
    tok_s = tokens / steady
    util = mfu.mfu(tok_s, per_token, 1, peak or mfu.H100_H200_PEAK)
    mem = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else float("nan")
    print(f"\n{mfu.convention()}")
    print(f"{'preset':12} {'params':>8} {'tokens/step':>11} {'first s':>8} {'median s':>9} {'tok/s':>9} {'MFU':>6} {'peak GiB':>8}")
    print(f"{args.preset:12} {spec.n_params / 1e9:7.3f}B {tokens:11d} {times[0]:8.2f} {steady:9.3f} {tok_s:9.0f} "
          f"{100 * util:5.1f}% {mem:8.1f}")
    return bool(torch.isfinite(loss).item())


def refuse(args) -> bool:
    code = (
        "import sys; sys.modules['fla'] = None\n"
        "from train.common.fastpath import select_kernels, FastPathError\n"
        "try:\n    select_kernels('cuda', capability=(9, 0), triton_version='3.6.0')\n"
        "except FastPathError as e:\n    print('REFUSED:', e); sys.exit(0)\n"
        "print('NOT REFUSED'); sys.exit(1)\n"
    )
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    print(proc.stdout.strip() or proc.stderr.strip())
    return proc.returncode == 0


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("check", choices=("equivalence", "step", "refuse"))
    parser.add_argument("--preset", default=None)
    parser.add_argument("--row-len", type=int, default=None)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--allow-slow-path", action="store_true")
    args = parser.parse_args()
    defaults = {"equivalence": ("tiny", 2048), "step": ("qwen35-2b", 8192), "refuse": ("tiny", 0)}[args.check]
    args.preset = args.preset or defaults[0]
    args.row_len = args.row_len or defaults[1]
    try:
        ok = {"equivalence": equivalence, "step": step, "refuse": refuse}[args.check](args)
    except FastPathError as exc:
        print(f"gpu_packing: {exc}", file=sys.stderr)
        return 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
