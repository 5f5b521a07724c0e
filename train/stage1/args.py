"""Stage 1's flags (Stage1Config), their parse and the checks `launch submit` runs before queueing.

No torch or transformers here, nor in what this imports (transformers only to load an
`--init-from` config): a refusal or a dry run answers in about a second, and the trainer itself
(train.stage1.train) is imported only where a job runs.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from train.common.codebooks import CodebookConfig, parse_lengths, parse_sizes
from train.common.config import ConfigError, json_object, opt, parse_config, require_sink
from train.common.hf_local import check_init_from, has_vision_tower
from train.common.shapes import SHAPES, get_shape
from train.stage1.tasks import (
    IMAGE_TASKS,
    TASKS,
    DataError,
    check_data_dir,
    check_weights,
    image_tasks_weighted,
)


@dataclass
class Stage1Config:
    """The trainer's flags. Defaults are the tiny CPU demo (512 tokens a step: 60 steps take a
    minute or two on 2 cores, loss ~8.5 -> ~3); the GPU shapes' values (8192-token rows, their
    lr and warmup, --vision off) are the job presets in launch/jobs/stage1.yaml."""

    shape: str = opt("tiny", help=f"model shape (train/common/shapes.py: {', '.join(SHAPES)})")
    steps: int = opt(60, help="optimizer steps")
    batch_rows: int = opt(2, help="packed rows per step per rank")
    row_len: int = opt(256, help="tokens per packed row (8192 on GPU)")
    lr: float = opt(3e-3, help="peak learning rate")
    min_lr_ratio: float = opt(0.1, help="final lr of the cosine, as a fraction of --lr")
    warmup: int = opt(5, help="linear warmup steps")
    weight_decay: float = opt(0.01)
    grad_clip: float = opt(1.0)
    seed: int = opt(0)
    out: str = opt(default_factory=lambda: os.environ.get("LAUNCH_JOB_DIR") or "./runs/stage1-local",
                   help="run directory (default: $LAUNCH_JOB_DIR, else ./runs/stage1-local)")
    data_dir: str | None = opt(None, help="dataset directory (default: <out>/data, synthetic, made when absent)")
    synthetic_samples: int = opt(2000)
    weights: dict[str, float] | None = opt(None, parse=json_object,
                                           help='mixture weights as JSON, e.g. \'{"gen_img": 2, "und": 1}\'')
    max_bad_fraction: float = opt(0.01, help="malformed records tolerated before the run stops")
    num_workers: int = opt(1)
    ckpt_every: int = opt(50, help="steps between checkpoints (and one at the end); 0: none, e.g. for benchmarks")
    keep_checkpoints: int = opt(2)
    restart: bool = opt(False, help="start from step 0: existing checkpoints are moved aside, never deleted")
    max_bad_steps: int = opt(0, help="non-finite steps to skip (update dropped) before the run stops")
    allow_slow_path: bool = opt(False, help="train on GPU without the fast kernels (loud)")
    allow_data_change: bool = opt(False, help="resume although the data differs from the checkpoint's (another "
                                  "--data-dir, --weights, --asset-lengths or tokenizer): the batches from the "
                                  "resumed step on are then not the original run's")
    deepspeed: str = opt("auto", choices=("auto", "on", "off"),
                         help="ZeRO-2; auto: on several CUDA ranks, plain torch otherwise")
    deepspeed_config: str | dict[str, Any] | None = opt(None, help="DeepSpeed config json (default: ZeRO-2)")
    init_from: str | None = opt(None, help="local transformers checkpoint dir")
    log_every: int = opt(1)
    profile_step: int = opt(0, help="run this step under torch.profiler and print its time by kernel family and "
                            "its top kernels (GPU kernels on CUDA): where the step goes; 0: off. That step's "
                            "own time is inflated by the profiler")
    wandb_project: str | None = opt(None, help="also log to this wandb project (needs wandb; WANDB_MODE=offline works "
                                     "without a network)")
    tensorboard: bool = opt(False, help="also write TensorBoard event files to <out>/tb (needs the metrics extra)")
    loss_impl: str = opt("auto", choices=("auto", "logits", "cce", "liger", "liger-sm90", "liger-sm90-tce"),
                         help="next-token loss kernel (auto: fused on CUDA, cut-cross-entropy first; liger-sm90: "
                         "Liger's Hopper CuTe DSL kernel, train/common/liger_sm90.py; liger-sm90-tce: the same "
                         "with a Triton cross-entropy pass)")
    vision: bool | None = opt(None, help="images through the shape's Qwen3.5 vision tower; off: the text-only "
                              "model (default: as --init-from has it, else on)")
    # The 3D asset format (default: the shape's).
    codebook_sizes: str | None = opt(None, help="3D codebook vocab sizes SS,SHAPE,TEX (default: the shape's)")
    asset_lengths: str | None = opt(None, help="codes per 3D asset SS,SHAPE,TEX, each a number or any "
                                    "(default: the shape's)")
    export: bool = opt(True, help="export the last checkpoint as a transformers checkpoint")
    # Speed levers (train/common/levers.py, measured by bench/stage1_levers.py); auto: on CUDA, off on CPU.
    compile: str = opt("auto", choices=("auto", "on", "off"),
                       help="regional torch.compile of the decoder layers (auto: on CUDA, off on CPU)")
    attention: str = opt("auto", choices=("auto", "varlen", "sdpa"),
                         help="full-attention kernel: varlen per document, or sdpa with a block-diagonal mask "
                              "(auto: varlen on CUDA, sdpa on CPU)")
    act_ckpt: int = opt(0, help="decoder layers with activation checkpointing (0: none)")
    compile_vision: str = opt("auto", choices=("auto", "off"),
                              help="regional compile of the vision tower's blocks too (auto: with --compile, when the "
                                   "tower's attention is varlen)")
    vision_ckpt: bool = opt(False, help="activation checkpointing of every vision tower block: its activations "
                            "are recomputed in the backward (less memory for images, one more tower forward)")
    packing: str = opt("auto", choices=("auto", "flat", "rows"),
                       help="batch layout: flat (one stream of batch_rows x row_len) or rows (auto: flat on CUDA)")
    vision_budget: str = opt("auto", help="vision tokens a step's images may hold, per rank: auto (from the model and "
                             "the device's memory, train/common/vision_budget.py), a number, or off")
    require_warm_kernels: bool = opt(False, help="fail the run when a baked kernel archive was unpacked for this node "
                                      "and kernels were compiled anyway by the end of step 1")
    conv_impl: str = opt("auto", choices=("auto", "causal-conv1d", "fla"),
                         help="GDN short-conv kernel on CUDA (auto: causal-conv1d when installed, else fla's Triton)")


def parse_args(argv: list[str] | None) -> Stage1Config:
    cfg = parse_config(Stage1Config, argv, "python -m train.stage1", "stage-1 AR pretraining")
    validate(cfg)
    return cfg


def vision_on(cfg: Stage1Config) -> bool:
    """--vision, or unset: what --init-from has (a vision_config or not); a random-init shape: on."""
    if cfg.vision is not None:
        return cfg.vision
    return has_vision_tower(cfg.init_from) if cfg.init_from else True


def check_tasks(cfg: Stage1Config, tasks: int) -> None:
    """`launch submit` calls this before anything is queued: image tasks never leave a run's mixture
    silently, so a text-only model (vision off, or an --init-from checkpoint without a tower) with
    image tasks weighted (the default mixture weights them) is refused here, in one line."""
    if vision_on(cfg):
        return
    weighted = image_tasks_weighted(cfg.weights)
    if weighted:
        text_only = json.dumps({t: 1 for t in TASKS if t not in IMAGE_TASKS})
        without = f"weights without them (--arg weights='{text_only}')"
        if cfg.init_from and not has_vision_tower(cfg.init_from):
            # --vision on would pass here and be refused at the job's start: offer only what trains
            raise ConfigError(f"task(s) {', '.join(weighted)} carry images but checkpoint {cfg.init_from} has no "
                              f"vision tower: use {without}, or an --init-from checkpoint with one")
        raise ConfigError(f"task(s) {', '.join(weighted)} carry images but --vision off: use --arg vision=on, or "
                          f"{without}")


def validate(cfg: Stage1Config) -> None:
    check_init_from(cfg.init_from, model_types=("qwen3_5", "qwen3_5_text"))
    if cfg.tensorboard:
        require_sink("tensorboard")
    if cfg.wandb_project is not None and not cfg.wandb_project.strip():
        raise ConfigError("--wandb-project is empty: name the wandb project, or leave the option out")
    if cfg.wandb_project:
        require_sink("wandb")
    if cfg.shape not in SHAPES:
        raise ConfigError(f"unknown model shape {cfg.shape!r}; valid shapes: {', '.join(SHAPES)}")
    for name in ("steps", "batch_rows", "row_len", "log_every", "synthetic_samples"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    if cfg.num_workers < 0:
        raise ConfigError(f"--num-workers must be >= 0, got {cfg.num_workers}")
    if cfg.keep_checkpoints < 1:
        raise ConfigError(f"--keep-checkpoints must be >= 1, got {cfg.keep_checkpoints}")
    if cfg.ckpt_every < 0 or cfg.max_bad_steps < 0 or cfg.act_ckpt < 0 or cfg.profile_step < 0:
        raise ConfigError("--ckpt-every, --max-bad-steps, --act-ckpt and --profile-step must be >= 0")
    if not (cfg.lr > 0 and math.isfinite(cfg.lr)):
        raise ConfigError(f"--lr must be a positive number, got {cfg.lr}")
    if not 0 <= cfg.min_lr_ratio <= 1:  # below 0 the cosine tail is a negative lr: gradient ascent; nan fails too
        raise ConfigError(f"--min-lr-ratio must be between 0 and 1 (a fraction of --lr), got {cfg.min_lr_ratio}")
    if not 0 <= cfg.max_bad_fraction <= 1:  # nan fails too: it would tolerate every bad record
        raise ConfigError(f"--max-bad-fraction must be between 0 and 1, got {cfg.max_bad_fraction}")
    if cfg.weights is not None:
        try:
            check_weights(cfg.weights)
        except DataError as exc:
            raise ConfigError(f"--weights: {exc}") from None
    if cfg.vision_budget not in ("auto", "off") and not (cfg.vision_budget.isdigit() and int(cfg.vision_budget) >= 1):
        raise ConfigError(f"--vision-budget must be auto, off or a number of tokens >= 1, got {cfg.vision_budget!r}")
    if cfg.vision_ckpt and cfg.vision is False:  # a setting that would do nothing, without a word
        raise ConfigError("--vision-ckpt on checkpoints the vision tower's blocks, and --vision off has no tower: "
                          "drop --vision-ckpt, or use --vision on")
    if cfg.vision and SHAPES[cfg.shape].vision is None:
        raise ConfigError(f"model shape {cfg.shape!r} has no vision tower; use --vision off")
    if cfg.vision and cfg.init_from and not has_vision_tower(cfg.init_from):
        raise ConfigError(f"--vision on: checkpoint {cfg.init_from}: no vision tower in its config.json; use --vision "
                          "off with text-only --weights, or an --init-from checkpoint with one")
    codebook_config(cfg)


def codebook_config(cfg: Stage1Config) -> CodebookConfig:
    """The run's 3D asset format: the shape's, with --codebook-sizes / --asset-lengths applied."""
    codebooks = get_shape(cfg.shape).codebooks
    try:
        if cfg.codebook_sizes:
            ss, shape, tex = parse_sizes(str(cfg.codebook_sizes))
            codebooks = replace(codebooks, ss=ss, shape=shape, tex=tex)
        if cfg.asset_lengths:
            codebooks = replace(codebooks, lengths=parse_lengths(str(cfg.asset_lengths)))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return codebooks


def input_paths(cfg: Stage1Config) -> list[tuple[str, str, Callable[[str], object] | None]]:
    """What the job reads at its start, for `launch submit` to check before queueing: (flag, path,
    the check of it where it exists on the submitting machine). A synthetic run (no --data-dir)
    reads nothing."""
    return [("--data-dir", cfg.data_dir, check_data_dir)] if cfg.data_dir else []


def gpu_work(cfg: Stage1Config) -> str | None:
    """What in this run needs a real GPU, or None when it runs on the CPU too (the tiny shape: its
    GPUs, if any are asked for, are only a task count). `launch submit` refuses GPU work on
    stand-in GPUs (a machine without the NVIDIA driver) with this as the reason."""
    return None if cfg.shape == "tiny" else f"model shape {cfg.shape}"
