"""Extraction's flags (ExtractConfig) and their parse: what `launch submit` vets before queueing,
without torch (transformers only to load an `--init-from` config)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from train.common.config import ConfigError, not_a_directory, opt, parse_config
from train.common.hf_local import check_init_from

DTYPE_NAMES = ("bfloat16", "float16", "float32")


@dataclass
class ExtractConfig:
    preset: str = opt("tiny", help="model shape of a random-init target (train/common/shapes.py); with "
                                   "--init-from the checkpoint's own config.json is the shape")
    init_from: str | None = opt(None, help="local transformers checkpoint dir of the target, used as it is")
    target_dtype: str = opt("auto", choices=("auto", *DTYPE_NAMES),
                            help="the target's compute dtype (auto: the checkpoint's own; random init: bf16 "
                                 "on GPU, fp32 on CPU)")
    data: str | None = opt(None, help='jsonl, one {"id", "input_ids": [...]} or {"id", "conversations": [...]} '
                                      "per line (default: <out>/data.jsonl, synthetic, made when absent)")
    tokenizer: str | None = opt(None, help="local dir of the target's tokenizer + chat template, for "
                                           "conversations (default: --init-from)")
    synthetic_samples: int = opt(160)
    out: str = opt(default_factory=lambda: os.environ.get("LAUNCH_JOB_DIR") or "./runs/extract-local",
                   help="shard directory (default: $LAUNCH_JOB_DIR, else ./runs/extract-local)")
    layers: str | None = opt(None, help="comma-separated decoder layer indices (0-based) to capture")
    n_layers: int = opt(5, help="without --layers: how many, spread over 1..L-3")
    token_budget: int = opt(8192, help="padded tokens per batch/shard (65536 on an H200)")
    max_len: int = opt(8192)
    dtype: str = opt("bfloat16", choices=DTYPE_NAMES,
                     help="storage dtype of the hidden states (bf16 halves fp32's ~24 KiB/token of the reference run)")
    seed: int = opt(0)
    sync_cmd: str | None = opt(None, help="shell template with {src} and {name}, run per finished shard")
    sync_check_cmd: str | None = opt(None, help="shell template with {name} printing the copy's sha256 first; "
                                                "local file deleted on match")
    stop_after: int | None = opt(None, parse=int, help="stop after writing this many shards")
    overlap: str = opt("auto", choices=("auto", "on", "off"),
                       help="write each shard (device-to-host copy into pinned memory, checks, write, index, "
                            "sync) on a background thread while the next batch runs through the target; "
                            "auto: on CUDA")
    compile: str = opt("auto", choices=("auto", "on", "off"),
                       help="torch.compile the target's layer regions (norms, MLP, projections; dynamic sizes: "
                            "one graph per region for every batch); auto: on CUDA")
    allow_slow_path: bool = opt(False)


def parse_args(argv: list[str] | None) -> ExtractConfig:
    cfg = parse_config(ExtractConfig, argv, "python -m train.extract", "hidden-state extraction to shards")
    for name, low in (("token_budget", 2), ("max_len", 2), ("n_layers", 1)):
        if getattr(cfg, name) < low:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(cfg, name)}")
    if cfg.max_len > cfg.token_budget:
        raise ConfigError(f"--max-len {cfg.max_len} exceeds --token-budget {cfg.token_budget}: a long sample "
                          "would not fit a batch; raise the budget or lower --max-len")
    if cfg.sync_check_cmd and not cfg.sync_cmd:
        raise ConfigError("--sync-check-cmd needs --sync-cmd")
    check_init_from(cfg.init_from)  # last: loading its config.json takes transformers (and torch)
    return cfg



def input_paths(cfg: ExtractConfig) -> list[tuple[str, str, Callable[[str], object] | None]]:
    """What the job reads at its start, for `launch submit` to check before queueing: (flag, path,
    the check of it where it exists on the submitting machine). No --data: a synthetic set."""
    return [("--data", cfg.data, not_a_directory("--data"))] if cfg.data else []


def gpu_work(cfg: ExtractConfig) -> str | None:
    """What in this run needs a real GPU, or None when it runs on the CPU too (the tiny random target)."""
    return None if cfg.preset == "tiny" and not cfg.init_from else f"the target {cfg.init_from or cfg.preset}"
