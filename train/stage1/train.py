"""Stage-1 AR pretraining loop: guard -> dist -> kernels -> model -> optimizer -> resume -> steps.

`python -m train.stage1 --preset tiny` always runs the Slurm guard first; `main(argv,
guard=False)` exists only so tests can drive the loop's internals outside Slurm.

Files written under --out (default $LAUNCH_JOB_DIR, else ./runs/stage1-local):
    metrics.jsonl       one record per step (appended; a resumed run appends more)
    checkpoints/        step_XXXXXXXX/ (MANIFEST.json-verified) and `latest`
    summary.json        steps, first/last loss, mean tok/s, paths; written atomically at the end
    data/               the synthetic dataset, generated there when --data-dir is not given
Re-running the same argv with the same --out resumes from checkpoints/latest at the same step
with the same next batch (this is what submitit's requeue does).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from toolkit.fsutil import atomic_write_text
from toolkit.metrics import step_records
from train.common.checkpoint import CheckpointError, CheckpointManager, rng_state, set_rng_state
from train.common.distributed import DistInfo, init_distributed, shutdown_distributed, slurm_layout
from train.common.entrypoint import run_entrypoint
from train.common.fastpath import FastPathError
from train.common.losses import LossImplError, select_loss_impl
from train.common.master_weights import MasterWeightAdamW, needs_master_weights
from train.common.metrics import MetricsLogger, compile_counts, peak_memory_mb
from train.common.packing import IGNORE_INDEX, model_kwargs
from train.common.profiler import StepProfiler, rank_spread
from train.stage1.data import TASKS, DataConfig, DataError, Stage1Data, generate_synthetic
from train.stage1.objective import CausalLMObjective

ENTRYPOINT = "train.stage1"


@dataclass
class Stage1Config:
    preset: str = "tiny"
    # These defaults are the tiny CPU demo; the command line fills unset ones per preset from
    # PRESET_DEFAULTS (8192-token rows and a smaller lr for the GPU shapes).
    steps: int = 60
    batch_rows: int = 2
    row_len: int = 256
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 5
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    out: str = field(default_factory=lambda: os.environ.get("LAUNCH_JOB_DIR") or "./runs/stage1-local")
    data_dir: str | None = None  # None: <out>/data, generated when absent
    synthetic_samples: int = 2000
    weights: dict[str, float] | None = None  # None: the reference run's per-task sample counts
    max_bad_fraction: float = 0.01
    num_workers: int = 1
    ckpt_every: int = 50
    keep_checkpoints: int = 2
    allow_slow_path: bool = False
    deepspeed: str = "auto"  # auto: ZeRO-2 on CUDA, plain torch on CPU; on | off
    deepspeed_config: str | dict[str, Any] | None = None  # path to a json, or a dict
    init_from: str | None = None
    log_every: int = 1
    wandb_project: str | None = None
    # auto: a fused linear cross-entropy (no full-vocab logits) on CUDA, plain logits on CPU.
    loss_impl: str = "auto"
    # Images through the preset's Qwen3.5 vision tower (Qwen3_5ForConditionalGeneration); off: the
    # text-only model, images as colour stand-in tokens. Per-preset default in PRESET_DEFAULTS.
    vision: bool = False


# Per-preset defaults for what the command line leaves unset. tiny: 512 tokens a step, so 60
# steps take a minute or two on 2 CPU cores and the loss falls from ~8.5 to ~3.
PRESET_DEFAULTS: dict[str, dict[str, Any]] = {
    "tiny": {"steps": 60, "batch_rows": 2, "row_len": 256, "lr": 3e-3, "warmup": 5, "vision": True},
    "qwen35-0.8b": {"steps": 20000, "batch_rows": 1, "row_len": 8192, "lr": 3e-4, "warmup": 500, "ckpt_every": 500},
    "qwen35-2b": {"steps": 20000, "batch_rows": 2, "row_len": 8192, "lr": 2e-4, "warmup": 500, "ckpt_every": 500},
}


def parse_args(argv: list[str] | None) -> Stage1Config:
    d = Stage1Config()
    p = argparse.ArgumentParser(prog="python -m train.stage1", description="stage-1 AR pretraining")
    p.add_argument("--preset", default=d.preset)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--batch-rows", type=int, default=None, help="packed rows per step per rank")
    p.add_argument("--row-len", type=int, default=None, help="tokens per packed row (8192 on GPU)")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", default=d.out)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--synthetic-samples", type=int, default=d.synthetic_samples)
    p.add_argument("--weights", default=None, help='mixture weights as JSON, e.g. \'{"gen_img": 2, "und": 1}\'')
    p.add_argument("--max-bad-fraction", type=float, default=d.max_bad_fraction)
    p.add_argument("--num-workers", type=int, default=d.num_workers)
    p.add_argument("--ckpt-every", type=int, default=None,
                   help="steps between checkpoints (and one at the end); 0: none, e.g. for benchmarks")
    p.add_argument("--allow-slow-path", action="store_true", help="train on GPU without the fast kernels (loud)")
    p.add_argument("--deepspeed", choices=("auto", "on", "off"), default=d.deepspeed)
    p.add_argument("--deepspeed-config", default=None, help="DeepSpeed config json (default: ZeRO-2)")
    p.add_argument("--init-from", default=None, help="local transformers checkpoint dir")
    p.add_argument("--log-every", type=int, default=d.log_every)
    p.add_argument("--wandb-project", default=None)
    p.add_argument("--loss-impl", choices=("auto", "logits", "cce", "liger"), default=d.loss_impl,
                   help="next-token loss kernel (auto: fused on CUDA)")
    p.add_argument("--vision", choices=("on", "off"), default=None,
                   help="images through the Qwen3.5 vision tower (default: on for tiny, off for the GPU presets)")
    a = p.parse_args(argv)
    if a.vision is not None:
        a.vision = a.vision == "on"
    weights = None
    if a.weights:
        try:
            weights = {str(k): float(v) for k, v in json.loads(a.weights).items()}
        except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
            raise ConfigError(f"--weights must be a JSON object of task -> number, got {a.weights!r}") from None
    given = {k: v for k, v in vars(a).items() if k != "weights" and v is not None}
    preset_defaults = PRESET_DEFAULTS.get(a.preset, {})
    cfg = Stage1Config(**{**preset_defaults, **given}, weights=weights)
    validate(cfg)
    return cfg


class ConfigError(ValueError):
    pass


def validate(cfg: Stage1Config) -> None:
    from train.stage1.model import PRESETS

    if cfg.preset not in PRESETS:
        raise ConfigError(f"unknown preset {cfg.preset!r}; valid presets: {', '.join(PRESETS)}")
    for name in ("steps", "batch_rows", "row_len", "log_every"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    if cfg.ckpt_every < 0:
        raise ConfigError(f"--ckpt-every must be >= 0 (0: no checkpoints), got {cfg.ckpt_every}")
    if not (cfg.lr > 0 and math.isfinite(cfg.lr)):
        raise ConfigError(f"--lr must be a positive number, got {cfg.lr}")
    if cfg.vision and PRESETS[cfg.preset].vision is None:
        raise ConfigError(f"preset {cfg.preset!r} has no vision tower; use --vision off")


# ---------------------------------------------------------------------------------------------


def lr_lambda(cfg: Stage1Config):
    def f(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        t = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))

    return f


def use_deepspeed(cfg: Stage1Config, device: torch.device, world_size: int) -> bool:
    # ZeRO-2 shards optimizer state and gradients across ranks; with one rank it only adds
    # overhead over a fused AdamW, so `auto` takes it on several CUDA ranks.
    return cfg.deepspeed == "on" or (cfg.deepspeed == "auto" and device.type == "cuda" and world_size > 1)


def make_optimizer(model: torch.nn.Module, cfg: Stage1Config, device: torch.device,
                   fused: bool | None = None, master_weights: bool | None = None) -> torch.optim.Optimizer:
    """AdamW; with fp32 master weights when the parameters are bf16 (train/common/master_weights.py).

    master_weights=None: on when the model has bf16/fp16 parameters. DeepSpeed keeps its own fp32
    masters, so its client optimizer must be a plain AdamW over the model's parameters (False).
    """
    # fused (default on CUDA): one kernel for the whole update instead of a loop over tensors.
    fused = device.type == "cuda" if fused is None else fused
    kwargs = {"lr": cfg.lr, "betas": (0.9, 0.95), "weight_decay": cfg.weight_decay, "fused": fused or None}
    if master_weights is None:
        master_weights = needs_master_weights(model)
    if master_weights:
        return MasterWeightAdamW(model.parameters(), **kwargs)
    return torch.optim.AdamW(model.parameters(), **kwargs)


def deepspeed_config(cfg: Stage1Config, device: torch.device) -> dict[str, Any]:
    if isinstance(cfg.deepspeed_config, dict):
        return cfg.deepspeed_config
    if cfg.deepspeed_config:
        return json.loads(Path(cfg.deepspeed_config).read_text())
    return {
        "train_micro_batch_size_per_gpu": cfg.batch_rows,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": 2, "overlap_comm": device.type == "cuda", "contiguous_gradients": True},
        "bf16": {"enabled": device.type == "cuda"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def losses(per_token: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean next-token loss, and per-task (sum, count) pairs for logging.

    `per_token` [B, T-1] is train.common.losses.token_losses: the term predicting labels[t] from
    position t-1, which belongs to task_ids[t] (labels are unshifted, packing.py).
    """
    labels = batch["labels"][:, 1:]
    tasks = batch["task_ids"][:, 1:]
    valid = labels != IGNORE_INDEX
    loss = per_token.sum() / valid.sum().clamp(min=1)
    per_task = {}
    with torch.no_grad():
        for i, task in enumerate(TASKS):
            m = valid & (tasks == i)
            per_task[task] = torch.stack([per_token.detach()[m].sum(), m.sum().to(per_token.dtype)])
    return loss, per_task


def reduce_task_losses(per_task: dict[str, torch.Tensor], dist_info: DistInfo) -> tuple[float, dict[str, float]]:
    """(loss over all ranks' tokens, per-task loss over all ranks) from per-rank (sum, count)."""
    stacked = torch.stack([per_task[t] for t in TASKS])  # [tasks, 2], on the device (nccl needs CUDA)
    if dist_info.world_size > 1:
        torch.distributed.all_reduce(stacked)
    total = float(stacked[:, 0].sum() / stacked[:, 1].sum().clamp(min=1))
    return total, {t: float(s / c) for t, (s, c) in zip(TASKS, stacked.tolist(), strict=True) if c > 0}


def main(argv: list[str] | None = None, guard: bool = True) -> int:
    """Entry point; returns the exit code. guard=False only for tests of the loop internals."""
    return run_entrypoint(ENTRYPOINT, argv, parse=parse_args, run=train, guard=guard,
                          config_errors=(ConfigError,),
                          run_errors=(DataError, CheckpointError, ConfigError, FastPathError, LossImplError))


def train(cfg: Stage1Config) -> int:
    from train.common import fastpath
    from train.stage1.model import build_model

    torch.manual_seed(cfg.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ds = use_deepspeed(cfg, device, world_size=slurm_layout()[1])
    dist_info = init_distributed(device, force_group=ds)
    if device.type == "cuda":
        device = torch.device("cuda", dist_info.local_rank)
    barrier = torch.distributed.barrier if dist_info.world_size > 1 or dist_info.initialized_here else lambda: None
    out = Path(cfg.out)
    log = MetricsLogger(out, enabled=dist_info.is_main, wandb_project=cfg.wandb_project)

    # Data: generate the synthetic set on first use (rank 0), then everyone opens it.
    data_dir = Path(cfg.data_dir) if cfg.data_dir else out / "data"
    if not cfg.data_dir and dist_info.is_main and not (data_dir / "gen_img.jsonl").exists():
        counts = generate_synthetic(data_dir, cfg.synthetic_samples, seed=cfg.seed, preset=cfg.preset)
        log.print(f"# generated synthetic data in {data_dir}: {counts}")
    barrier()

    # Kernels before the model exists: on GPU this refuses to go on without the fast path.
    kernels = fastpath.select_kernels(device, allow_slow_path=cfg.allow_slow_path)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, spec = build_model(cfg.preset, device=device, dtype=dtype, init_from=cfg.init_from, vision=cfg.vision)
    fastpath.install_kernels(model, kernels)
    loss_impl = select_loss_impl(device, cfg.loss_impl)
    objective = CausalLMObjective(model, loss_impl)

    opt = make_optimizer(model, cfg, device, master_weights=False if ds else None)
    optimizer_name = "deepspeed-zero2" if ds else ("adamw+fp32-masters" if isinstance(opt, MasterWeightAdamW)
                                                   else "adamw")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    engine = None
    forward: torch.nn.Module = objective
    if ds:
        import deepspeed

        engine, opt, _, sched = deepspeed.initialize(
            model=objective, optimizer=opt, lr_scheduler=sched, config=deepspeed_config(cfg, device)
        )
        forward = engine
    elif dist_info.world_size > 1:  # --deepspeed off on several ranks: plain DDP keeps them in sync
        forward = torch.nn.parallel.DistributedDataParallel(
            objective, device_ids=[device.index] if device.type == "cuda" else None
        )

    # Resume: model/optimizer/scheduler, RNG, step and the data position.
    ckpts = CheckpointManager(out / "checkpoints", keep=cfg.keep_checkpoints)
    step, data_state = 0, {"next_batch": 0}
    latest = ckpts.latest()
    if latest is not None:
        step, data_state = load_checkpoint(latest, model, opt, sched, engine, dist_info)
        log.print(f"# resumed from {latest} at step {step}, next batch {data_state['next_batch']}")
    data = Stage1Data(
        DataConfig(
            str(data_dir), preset=cfg.preset, row_len=cfg.row_len, batch_rows=cfg.batch_rows, seed=cfg.seed,
            weights=cfg.weights, max_bad_fraction=cfg.max_bad_fraction, num_workers=cfg.num_workers,
            vision=cfg.vision,
        ),
        rank=dist_info.rank, start_batch=int(data_state["next_batch"]), report=log.print,
    )
    flops_per_token, peak_flops, peak_source = mfu_terms(model, cfg, device)
    log.header({
        "preset": cfg.preset, "params": spec.n_params, "vocab": spec.vocab.padded_vocab, "device": device.type,
        "world": dist_info.world_size, "deepspeed": ds, "row_len": cfg.row_len, "batch_rows": cfg.batch_rows,
        "start_step": step, "steps": cfg.steps, "flops_per_token": f"{flops_per_token:.4g}",
        "mfu_peak": f"{peak_flops:.4g} ({peak_source})", "loss_impl": loss_impl,
        "optimizer": optimizer_name,
        "vision_params": spec.n_vision_params,
    })
    log.print("# " + kernels.header().replace("\n", "\n# "))

    prof = StepProfiler(device)
    model.train()
    first_loss = last_loss = None
    while step < cfg.steps:
        prof.start_step()
        batch = next(data)
        prof.data_ready()
        loss, per_task = train_step(forward, model, opt, sched, engine, batch, device, cfg.grad_clip,
                                    after_forward=prof.forward_done)
        loss_value = float(loss.detach())  # .item() syncs; the profiler's end_step syncs anyway
        # tokens/s and MFU count every token of the packed rows, padding included (torchtitan);
        # real_tok_s leaves the padding out.
        timing = prof.end_step(batch["input_ids"].numel() * dist_info.world_size)
        step += 1
        if step % cfg.log_every == 0 or step == cfg.steps:
            global_loss, task_loss = reduce_task_losses(per_task, dist_info)
            compiles, recompiles = compile_counts()
            tok_s = timing.tokens_per_s
            log.log_step({
                "step": step, "loss": global_loss, "task_loss": task_loss, "tok_s": tok_s,
                "real_tok_s": tok_s * batch["packing_efficiency"],
                "mfu": tok_s * flops_per_token / (peak_flops * dist_info.world_size),
                "data_ms": timing.data_ms, "compute_ms": timing.compute_ms, "peak_mem_mb": peak_memory_mb(device),
                "compiles": compiles, "recompiles": recompiles, "lr": sched.get_last_lr()[0],
                "packing_efficiency": batch["packing_efficiency"], "batch_index": batch["batch_index"],
                "batch_digest": batch_digest(batch), "fwd_ms": timing.forward_ms,
                **(rank_spread(timing, device) if dist_info.world_size > 1 else {}),
            })
        first_loss = loss_value if first_loss is None else first_loss
        last_loss = loss_value
        if cfg.ckpt_every and (step % cfg.ckpt_every == 0 or step == cfg.steps):
            save_checkpoint(ckpts, step, model, opt, sched, engine, data.state_dict(), cfg, dist_info, barrier)
    data.close()

    if dist_info.is_main:
        summary = {
            "steps": step, "first_loss": first_loss, "last_loss": last_loss,
            "mean_tok_s": prof.mean_tokens_per_s if prof.total_s else None,  # all ranks together
            "out_dir": str(out.resolve()), "metrics": str((out / "metrics.jsonl").resolve()),
            "checkpoint": str((out / "checkpoints").resolve()), "preset": cfg.preset,
        }
        summary.update(_loss_span(out / "metrics.jsonl"))
        atomic_write_text(out / "summary.json", json.dumps(summary, indent=1) + "\n")
        log.print(f"# done: {json.dumps(summary)}")
    log.close()
    shutdown_distributed(dist_info)
    return 0


def train_step(forward: torch.nn.Module, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any,
               engine: Any, batch: dict[str, Any], device: torch.device, grad_clip: float,
               after_forward: Callable[[], None] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One optimizer step on one batch: forward (model + loss), backward, clip, update.

    `after_forward` runs between the loss and the backward (the profiler's forward mark).
    bench/stage1_gpu.py times exactly this function.
    """
    kwargs = {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v)
              for k, v in model_kwargs(batch).items()}
    target = {k: batch[k].to(device, non_blocking=True) for k in ("labels", "task_ids")}
    per_token = forward(**kwargs)
    loss, per_task = losses(per_token, target)
    if after_forward is not None:
        after_forward()
    if engine is not None:
        engine.backward(loss)
        engine.step()
    else:
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    return loss, per_task


def batch_digest(batch: dict[str, Any]) -> str:
    """Short hash of a batch's tokens: lets a resumed run prove it sees the same next batch."""
    return hashlib.sha1(batch["input_ids"].numpy().tobytes()).hexdigest()[:16]


def _loss_span(metrics_path: Path) -> dict[str, Any]:
    """first/last loss over the whole run, including steps before a resume."""
    recs = step_records(metrics_path) if metrics_path.exists() else []
    if not recs:
        return {}
    return {"first_loss": recs[0]["loss"], "last_loss": recs[-1]["loss"],
            "mean_tok_s_logged": sum(r["tok_s"] for r in recs) / len(recs)}


def mfu_terms(model: torch.nn.Module, cfg: Stage1Config, device: torch.device) -> tuple[float, float, str]:
    """(model FLOPs per token, peak FLOP/s of one device, where the peak comes from).

    On a CPU (or an unknown GPU) MFU is stated against the H100/H200 bf16 peak, so the number is
    comparable in form but only the GPU one means utilisation. The text model's FLOPs only: the
    vision tower's are not counted (its share depends on how many image patches a batch holds).
    """
    from train.common import mfu
    from train.stage1.model import text_model_config

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = mfu.peak_flops(name)
    source = name
    if peak is None:
        peak, source = mfu.H100_H200_PEAK, f"{name}: unknown peak, H100/H200 bf16 used as reference"
    return mfu.flops_per_token(text_model_config(model), cfg.row_len), peak, source


# ---------------------------------------------------------------------------------------------
# checkpoints


def save_checkpoint(ckpts, step, model, opt, sched, engine, data_state, cfg, dist_info, barrier) -> None:
    def write(tmp: Path) -> None:
        trainer = {"step": step, "data": data_state, "rng": rng_state(), "config": dataclasses.asdict(cfg)}
        torch.save(trainer, tmp / f"trainer_rank{dist_info.rank:05d}.pt")
        if engine is not None:
            engine.save_checkpoint(str(tmp), tag="deepspeed")
        elif dist_info.is_main:
            torch.save(model.state_dict(), tmp / "model.pt")
            torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, tmp / "optim.pt")

    ckpts.save(step, write, is_main=dist_info.is_main, barrier=barrier)


def load_checkpoint(path: Path, model, opt, sched, engine, dist_info) -> tuple[int, dict[str, Any]]:
    trainer_file = path / f"trainer_rank{dist_info.rank:05d}.pt"
    if not trainer_file.is_file():
        raise CheckpointError(f"{trainer_file} is missing: checkpoint {path} was written by a different world size")
    trainer = torch.load(trainer_file, weights_only=False)
    if engine is not None:
        engine.load_checkpoint(str(path), tag="deepspeed")
    else:
        model.load_state_dict(torch.load(path / "model.pt", map_location="cpu", weights_only=True))
        state = torch.load(path / "optim.pt", map_location="cpu", weights_only=False)
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
    set_rng_state(trainer["rng"])
    return int(trainer["step"]), trainer["data"]
