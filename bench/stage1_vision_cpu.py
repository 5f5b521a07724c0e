"""Tiny stage-1 step on CPU: text-only model (image stand-in tokens) vs the vision tower, side by side.

Both variants run the trainer's own `train_step` (reference kernels, plain AdamW) on the same
synthetic dataset and the same batch indices: `text` is `--vision off` (an image is 16 colour
stand-in tokens, Qwen3_5ForCausalLM), `vision` is `--vision on` (PNG -> pixel_values -> the tiny
Qwen3.5 vision tower, Qwen3_5ForConditionalGeneration). Steps alternate between the variants so
that load from other processes on a shared machine hits both alike. Prints one table row per
variant: median step ms (data excluded: batches are built before timing), and the ratio.

    python bench/stage1_vision_cpu.py --steps 30 --row-len 256 --batch-rows 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from train.common import fastpath  # noqa: E402
from train.common.distributed import DistInfo  # noqa: E402
from train.common.shapes import get_shape  # noqa: E402
from train.stage1.data import DataConfig, PackedBatches, build_batch  # noqa: E402
from train.stage1.model import build_model  # noqa: E402
from train.stage1.objective import CausalLMObjective  # noqa: E402
from train.stage1.synthetic import generate_synthetic  # noqa: E402
from train.stage1.tokenizer import build_tokenizer  # noqa: E402
from train.stage1.train import Stage1Config, make_stepper, train_step  # noqa: E402

ONE_RANK = DistInfo(0, 1, 0, "127.0.0.1", 0, "gloo", False)


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--row-len", type=int, default=256)
    p.add_argument("--batch-rows", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device("cpu")
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        generate_synthetic(data, samples=2000, seed=0)
        variants = {}
        for name, vision in (("text", False), ("vision", True)):
            torch.manual_seed(0)
            tok = build_tokenizer(get_shape("tiny"), None, vision)
            model, spec = build_model("tiny", vision=vision, vision_ids=tok.vision_ids)
            fastpath.install_kernels(model, fastpath.select_kernels(device))
            cfg = Stage1Config(shape="tiny", steps=a.steps + a.warmup, row_len=a.row_len, batch_rows=a.batch_rows,
                               vision=vision)
            objective = CausalLMObjective(model, "logits")
            stepper = make_stepper(objective, model, cfg, device, ONE_RANK, ds=False)
            ds = PackedBatches(DataConfig(str(data), row_len=a.row_len, batch_rows=a.batch_rows), tok, 0)
            batches = [build_batch(ds.sampler, ds.tok, ds.cfg, k) for k in range(a.steps + a.warmup)]
            variants[name] = dict(model=model, spec=spec, stepper=stepper, batches=batches, times=[], losses=[])
        for k in range(a.steps + a.warmup):
            for v in variants.values():
                t = time.perf_counter()
                loss = train_step(v["stepper"], v["batches"][k], device).loss
                dt = time.perf_counter() - t
                v["losses"].append(loss)
                if k >= a.warmup:
                    v["times"].append(dt)
    base = statistics.median(variants["text"]["times"])
    print("| variant | params | vision params | images/step | median step ms | vs text | first loss | last loss |")
    print("|---|---|---|---|---|---|---|---|")
    for name, v in variants.items():
        med = statistics.median(v["times"])
        n_img = statistics.mean(len(b.get("image_grid_thw", [])) for b in v["batches"])
        print(f"| {name} | {v['spec'].n_params:,} | {v['spec'].n_vision_params:,} | {n_img:.1f} | {1000 * med:.1f} | "
              f"{med / base:.2f}x | {v['losses'][0]:.3f} | {v['losses'][-1]:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
