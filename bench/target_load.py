"""Peak host RSS of loading a >= 1B-parameter bf16 checkpoint as the DFlash/extraction target.

    python bench/target_load.py [--dir /tmp/target-1b] [--layers 12] [--shard-gib 2] [--device cpu|cuda]
                                [--old]

The checkpoint is made cheaply: a Qwen3.5 text config (the `qwen35-2b` shape, `--layers` decoder
layers, vocab 248,320; 12 layers = 1.19 B parameters), its state dict's names and shapes taken
from a model built on the meta device, each tensor random bf16, written shard by shard with
safetensors (at most `--shard-gib` per file, the index beside them, as save_pretrained lays out
a sharded checkpoint), so the writer never holds more than one shard. Each load then runs in a
fresh process that reports its own peak RSS (/proc/self/status VmHWM; getrusage's ru_maxrss
would carry the writing parent's peak over fork and exec):
  - new: train.extract.target.load_target (what extraction and online DFlash run), onto --device;
  - old (--old): the stage-1 builder as extraction used it before (fp32 from_pretrained on the
    host, codebook rows appended, then cast and moved).
The acceptance bound is 1.3 x the largest shard + 2 GiB. On a CPU rank the model itself lives in
host memory (its bf16 bytes are part of the figure); on a GPU rank they are not.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from toolkit import pyexec  # noqa: E402

LOAD = """
import sys, time, torch
sys.path.insert(0, {root!r})
t = time.perf_counter()
dev = torch.device({device!r})
if {mode!r} == "baseline":  # the runtime alone: torch, transformers, a CUDA context
    import transformers
    torch.ones(1, device=dev)
    n = 0
elif {mode!r} == "old":
    from train.stage1.model import build_model
    model, _ = build_model("qwen35-2b", device=dev, dtype=torch.bfloat16, init_from={path!r})
    n = sum(p.numel() for p in model.parameters())
else:
    from train.extract.target import load_target
    target = load_target({path!r}, "qwen35-2b", dev)
    n = sum(p.numel() for p in target.base.parameters())
if dev.type == "cuda":
    torch.cuda.synchronize()
# VmHWM: this process image's own peak RSS (ru_maxrss keeps the forking parent's across exec)
hwm = [int(x.split()[1]) * 1024 for x in open("/proc/self/status") if x.startswith("VmHWM:")][0]
print("RESULT", n, hwm, time.perf_counter() - t)
"""


def make_checkpoint(out: Path, layers: int, shard_gib: float) -> tuple[int, int]:
    """Write the checkpoint; (parameters, largest shard bytes)."""
    from safetensors.torch import save_file
    from transformers import Qwen3_5ForCausalLM

    from train.common.shapes import get_shape
    from train.stage1.model import text_config

    out.mkdir(parents=True, exist_ok=True)
    shape = get_shape("qwen35-2b")
    cfg = text_config(shape)
    cfg.num_hidden_layers = layers
    cfg.layer_types = cfg.layer_types[:layers]
    cfg.dtype = torch.bfloat16
    with torch.device("meta"):
        meta = Qwen3_5ForCausalLM(cfg)
    names = [(k, tuple(v.shape)) for k, v in meta.state_dict().items() if k != "lm_head.weight"]  # tied
    n_params = sum(int(torch.Size(s).numel()) for _, s in names)
    limit = int(shard_gib * 2**30)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for k, s in names:
        b = int(torch.Size(s).numel()) * 2
        if size + b > limit and shards[-1]:
            shards.append([])
            size = 0
        shards[-1].append((k, s))
        size += b
    weight_map, largest = {}, 0
    gen = torch.Generator().manual_seed(0)
    for i, part in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {k: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for k, s in part}
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        largest = max(largest, (out / name).stat().st_size)
        weight_map.update({k: name for k in tensors})
        del tensors
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg.save_pretrained(out)
    return n_params, largest


def measure(path: Path, device: str, mode: str) -> tuple[int, int, float]:
    code = LOAD.format(root=str(ROOT), device=device, mode=mode, path=str(path))
    done = subprocess.run([*pyexec.python(), "-c", code], capture_output=True, text=True)
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT")]
    if done.returncode != 0 or not line:
        raise SystemExit(f"load failed (rc {done.returncode}): {(done.stderr.strip().splitlines() or [''])[-1]}")
    _, n, rss, sec = line[0].split()
    return int(n), int(rss), float(sec)


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="/tmp/target-1b")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--shard-gib", type=float, default=2.0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--old", action="store_true", help="also the stage-1 builder's fp32 path (needs ~4x the RAM)")
    args = p.parse_args()
    out = Path(args.dir)
    n_params, largest = make_checkpoint(out, args.layers, args.shard_gib)
    bound = 1.3 * largest + 2 * 2**30
    print(f"# checkpoint {out}: {n_params / 1e9:.3f} B parameters, bf16, "
          f"{len(list(out.glob('*.safetensors')))} shards, largest {largest / 2**30:.2f} GiB; "
          f"bound 1.3 x largest + 2 GiB = {bound / 2**30:.2f} GiB", flush=True)
    print("| loader | device | parameters loaded | peak host RSS GiB | bound GiB | within | seconds |")
    print("|---|---|---:|---:|---:|---|---:|")
    names = {"baseline": "runtime only (torch, transformers, device context)", "new": "load_target",
             "old": "stage-1 builder (before)"}
    for mode in ["baseline", "new"] + (["old"] if args.old else []):
        n, rss, sec = measure(out, args.device, mode)
        name = names[mode]
        print(f"| {name} | {args.device} | {n / 1e9:.3f} B | {rss / 2**30:.2f} | {bound / 2**30:.2f} | "
              f"{'yes' if rss <= bound else 'NO'} | {sec:.1f} |", flush=True)


if __name__ == "__main__":
    main()
