"""Regeneration's flags (RegenConfig) and their parse: what `launch submit` vets before queueing,
without torch until the target's config.json is loaded (the last check)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

from train.common.config import ConfigError, not_a_directory, opt, parse_config
from train.common.hf_local import check_init_from


@dataclass
class RegenConfig:
    init_from: str = opt("", help="the target's local checkpoint dir (weights, tokenizer, chat template)")
    data: str = opt("", help='jsonl of {"id", "conversations": [...]}')
    tokenizer: str | None = opt(None, help="the target's tokenizer dir (default: --init-from)")
    out: str = opt(default_factory=lambda: os.environ.get("LAUNCH_JOB_DIR") or "./runs/regen-local",
                   help="output dir (default: $LAUNCH_JOB_DIR, else ./runs/regen-local)")
    batch_size: int = opt(16, help="conversations per generate call (= per part file)")
    max_new_tokens: int = opt(1024)
    temperature: float = opt(0.7, help="0 = greedy")
    top_p: float = opt(0.8)
    top_k: int = opt(20)
    seed: int = opt(0)
    stop_after: int | None = opt(None, parse=int, help="write at most this many parts, then stop")
    allow_slow_path: bool = opt(False)


def parse_args(argv: list[str] | None) -> RegenConfig:
    cfg = parse_config(RegenConfig, argv, "python -m train.regen", "regenerate assistant turns with the target")
    if not cfg.init_from or not cfg.data:
        raise ConfigError("needs --init-from <the target's checkpoint dir> and --data <conversations jsonl>")
    if cfg.batch_size < 1 or cfg.max_new_tokens < 1 or cfg.top_k < 0:
        raise ConfigError("--batch-size and --max-new-tokens must be >= 1, --top-k >= 0")
    if not (cfg.temperature >= 0 and math.isfinite(cfg.temperature)) or not 0 < cfg.top_p <= 1:
        raise ConfigError("--temperature must be >= 0 and --top-p in (0, 1]")
    check_init_from(cfg.init_from)  # last: loading its config.json takes transformers (and torch)
    return cfg



def input_paths(cfg: RegenConfig) -> list[tuple[str, str, Callable[[str], object] | None]]:
    """What the job reads at its start, for `launch submit` to check before queueing: (flag, path,
    the check of it where it exists on the submitting machine)."""
    return [("--data", cfg.data, not_a_directory("--data"))]


def gpu_work(cfg: RegenConfig) -> str | None:
    """Generation with the target: GPU work whenever the job asks for GPUs (the tiny preset asks none)."""
    return f"generation with the target {cfg.init_from}"
