"""DFlash's flags (DFlashConfig), their parse and the topology check `launch submit` runs before
queueing, without torch (transformers only to load an `--init-from` config)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from train.common.config import ConfigError, not_a_directory, opt, parse_config
from train.common.hf_local import check_init_from

# The published blocks: 16 slots for DFlash, 8 for DFlash2 (SpecForge configs/*-dflash2.json).
DFLASH_BLOCK, DFLASH2_BLOCK = 16, 8
DFLASH2_DRAFTERS = ("dflash2", "qwen3.6-27b-dflash2")  # train.dflash.model's DFlash2 presets


def default_block_size(drafter: str) -> int:
    """--block-size when not given: DFlash2's published 8 for its presets (or a JSON drafter that
    sets conv_kernel_size), else 16."""
    if drafter in DFLASH2_DRAFTERS:
        return DFLASH2_BLOCK
    path = Path(drafter)
    if path.suffix == ".json" and path.is_file():
        import json

        try:
            fields = json.loads(path.read_text())
        except (OSError, ValueError):
            return DFLASH_BLOCK  # the drafter's own check says what is wrong with the file
        if isinstance(fields, dict) and fields.get("conv_kernel_size"):
            return int(fields.get("block_size") or DFLASH2_BLOCK)
    return DFLASH_BLOCK


def parse_topology(text: str) -> tuple[int, int]:
    """'k-m' -> (k target ranks, m drafter ranks)."""
    parts = text.split("-")
    if len(parts) != 2 or not all(p.isdigit() for p in parts) or min(int(p) for p in parts) < 1:
        raise ValueError(f"--topology must be 'k-m' (k target ranks, m data-parallel drafter ranks, each >= 1), "
                         f"got {text!r}")
    return int(parts[0]), int(parts[1])


@dataclass
class DFlashConfig:
    mode: str = opt("offline", choices=("offline", "online"))
    data: str | None = opt(None, help="offline: extraction dir; online: jsonl (default: synthetic in <out>/data.jsonl)")
    topology: str = opt("2-1", help="online: k target ranks - m drafter ranks (data-parallel, gradients "
                                    "all-reduced); auto: probe the target forward and the drafter step here, print "
                                    "the k-m split of the node it picks and exit")
    plan_gpus: int | None = opt(None, help="--topology auto: the GPUs to split (default: the job's tasks)")
    preset: str = opt("tiny", help="online: model shape of a random-init target (with --init-from the "
                                   "checkpoint's config.json is the shape)")
    init_from: str | None = opt(None, help="online: local checkpoint of the target, used as it is")
    target_dtype: str = opt("auto", choices=("auto", "bfloat16", "float16", "float32"),
                            help="online: the target's compute dtype (auto: the checkpoint's own)")
    layers: str | None = opt(None, help="online: captured target layers (default: n_layers spread over 1..L-3)")
    n_layers: int = opt(5)
    tokenizer: str | None = opt(None, help="online: the target's tokenizer dir, for conversations (default: --init-from)")
    drafter: str = opt("auto", help="drafter preset (qwen3.5: the published 5 layers of 32x128 heads, 8 kv heads; "
                                    "qwen3.6-27b: the published Qwen3.6-27B drafter, those heads, MLP 17408, "
                                    "4 sliding-window layers (2048) then a full one; qwen3.6-27b-dflash2: the "
                                    "published Qwen3.6-27B DFlash2 drafter, 5 sliding layers, block 8; target: 5 "
                                    "layers with the target's head layout; tiny; dflash2: DFlash2's convolutions "
                                    "and candidate selector on the layout auto picks) or JSON file of "
                                    "DrafterConfig fields; auto: qwen3.6-27b for a 5120-wide 64-layer target, else "
                                    "qwen3.5, tiny for test-sized targets")
    mask_token: str = opt("auto", help="the block's mask token: an id or a token of the target's tokenizer; auto: "
                                       "248070 for Qwen3.5's tokenizer (the published configs'; also a stage-1 "
                                       "export of Qwen3.5, whose 3D rows follow it), else the tokenizer's pad "
                                       "token, else the last row")
    block_size: int | None = opt(None, parse=int, help=f"slots per block (default: {DFLASH2_BLOCK} for a DFlash2 "
                                                      f"drafter, its published block; else {DFLASH_BLOCK})")
    selector_alpha: float = opt(1.0, help="DFlash2: weight of the candidate selector's CE beside the token CE")
    anchors: int = opt(512, help="anchors per sequence (SpecForge's default), clamped to its response positions")
    max_bad_fraction: float = opt(0.01, help="offline: shards failing verification are skipped up to this share")
    steps: int = opt(40)
    token_budget: int = opt(2048, help="padded tokens per batch")
    max_len: int = opt(8192, help="online: samples are cut to this many tokens")
    lr: float = opt(3e-3)
    warmup: int = opt(4)
    weight_decay: float = opt(0.0)
    grad_clip: float = opt(1.0)
    gamma: float | None = opt(None, parse=float, help="slot loss weights exp(-(j-1)/gamma); 0 = uniform; default: "
                                                     "from --block-size (7 at 16, 5 at 10, 4 at 8, else 7K/16)")
    kl_weight: float = opt(0.0, help="weight of KL(verifier || drafter) on the anchor blocks")
    queue_depth: int = opt(4, help="online: messages in flight per target rank")
    seed: int = opt(0)
    synthetic_samples: int = opt(160)
    out: str = opt(default_factory=lambda: os.environ.get("LAUNCH_JOB_DIR") or "./runs/dflash-local",
                   help="run directory (default: $LAUNCH_JOB_DIR, else ./runs/dflash-local)")
    ckpt_every: int = opt(50)
    log_every: int = opt(1)
    restart: bool = opt(False, help="start from step 0: existing checkpoints are moved aside, never deleted")
    max_bad_steps: int = opt(0, help="non-finite steps to skip (update dropped) before the run stops")
    allow_slow_path: bool = opt(False)
    # Matmuls of the drafter step in bf16 under autocast, fp32 weights and optimizer. auto: on
    # CUDA (an fp32 drafter was the bottleneck of the 1-1 topology on H200s), off on CPU.
    amp: str = opt("auto", choices=("auto", "bf16", "off"))
    # auto: block-sparse flex_attention (compiled) on CUDA, the dense chunked reference on CPU
    attn_impl: str = opt("auto", choices=("auto", "dense", "flex"))
    # torch.compile of each drafter layer's regions around the attention (norms, rotary, MLP,
    # residuals): auto = on CUDA, off on the CPU
    compile: str = opt("auto", choices=("auto", "on", "off"))
    # the anchor-block CE: auto = onepass on CUDA, logits on CPU. onepass: the frozen head's CE
    # with its gradient made in the forward per chunk (no recompute: 4 x rows x vocab x hidden
    # FLOPs where cce does 6; bf16 logits of one chunk at a time); cce/liger: stage-1's fused kernels
    loss_impl: str = opt("auto", choices=("auto", "logits", "cce", "liger", "onepass"))
    # the accuracy metrics (acc, acc_slot, acc1, tau, target_agree) need each row's argmax, a second
    # lm_head pass on the fused path: measured on this many evenly strided rows of the step (the
    # record's acc_rows), ~1% of a 27B step instead of ~16% over all; 0: every row
    acc_rows: int = opt(4096, help="rows of the step the accuracy metrics are measured on (0: all)")


def parse_args(argv: list[str] | None) -> DFlashConfig:
    cfg = parse_config(DFlashConfig, argv, "python -m train.dflash", "DFlash drafter training")
    if cfg.mode == "offline" and not cfg.data:
        raise ConfigError("--mode offline needs --data <extraction dir> (from `launch submit extract`)")
    for name in ("steps", "anchors", "token_budget", "ckpt_every", "log_every", "queue_depth"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
    if cfg.acc_rows < 0:
        raise ConfigError("--acc-rows must be >= 0 (0: every row)")
    if cfg.block_size is None:
        cfg.block_size = default_block_size(cfg.drafter)
    if cfg.selector_alpha < 0 or not math.isfinite(cfg.selector_alpha):
        raise ConfigError(f"--selector-alpha must be a number >= 0, got {cfg.selector_alpha}")
    if cfg.block_size < 2:
        raise ConfigError(f"--block-size must be >= 2 (the anchor and at least one token to predict), got {cfg.block_size}")
    if not 0.0 <= cfg.max_bad_fraction <= 1.0:
        raise ConfigError(f"--max-bad-fraction must lie in [0, 1], got {cfg.max_bad_fraction}")
    if not (cfg.lr > 0 and math.isfinite(cfg.lr)):
        raise ConfigError(f"--lr must be a positive number, got {cfg.lr}")
    if cfg.mode == "online" and cfg.topology != "auto":
        try:
            parse_topology(cfg.topology)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    check_init_from(cfg.init_from)  # last: loading its config.json takes transformers (and torch)
    check_mask_token(cfg)
    return cfg


def check_mask_token(cfg: DFlashConfig) -> None:
    """At submit: an id is a row of an embedding (>= 0), and of the target's when its config is
    here (--init-from); a token is checked against the tokenizer when the run starts."""
    spec = cfg.mask_token.strip()
    if not spec.lstrip("-").isdigit():
        return
    mask = int(spec)
    vocab = None
    if cfg.init_from:
        from train.common.hf_local import load_config

        text = load_config(cfg.init_from)
        text = text.get_text_config() if hasattr(text, "get_text_config") else text
        vocab = getattr(text, "vocab_size", None)
    if mask < 0 or (vocab is not None and mask >= vocab) or mask >= 1 << 31:
        rows = f"the target's {vocab}-row embedding" if vocab is not None else "an embedding (ids are >= 0)"
        raise ConfigError(f"--mask-token {spec}: id {mask} is not a row of {rows}")


def check_tasks(cfg: DFlashConfig, tasks: int) -> None:
    """`launch submit` calls this with the job's task count before anything is queued."""
    if cfg.mode == "online" and cfg.topology == "auto":
        if (cfg.plan_gpus or tasks) < 2:
            raise ConfigError(f"--topology auto splits the node's GPUs k-m: the job needs >= 2 tasks, it has {tasks}")
        return
    check_layout(cfg, tasks)


# The topology fixes the job's task count (k targets + m drafters, or 1 offline): the launcher's
# advice for a request too big for the cluster is then a smaller preset, never fewer GPUs.
check_tasks.fixes_task_count = True  # type: ignore[attr-defined]


def check_layout(cfg: DFlashConfig, world: int) -> tuple[int, int]:
    """(target ranks, drafter ranks): (0, 1) offline; the job's task count (`world`) must fit the topology."""
    if cfg.mode != "online":
        if world > 1:
            raise ConfigError(f"--mode offline trains one drafter on one rank; this job has {world} "
                              "tasks (use the `offline` preset, or --gpus-per-node 1)")
        return 0, 1
    n_targets, n_drafters = parse_topology(cfg.topology)
    if world != n_targets + n_drafters:
        raise ConfigError(f"--topology {cfg.topology} needs {n_targets + n_drafters} ranks, this job has "
                          f"{world}; set the job's GPUs/tasks to {n_targets + n_drafters}")
    return n_targets, n_drafters



def _extraction_dir(path: str) -> None:
    if not Path(path).is_dir():
        raise ConfigError(f"--data {path}: a file, not an extraction directory (--data takes the directory "
                          "`launch submit extract` wrote)")
    if not (Path(path) / "meta.json").is_file():
        raise ConfigError(f"--data {path}: no meta.json there, not an extraction directory (run `launch submit "
                          "extract` first, then --arg data=job:<its id>)")


def input_paths(cfg: DFlashConfig) -> list[tuple[str, str, Callable[[str], object] | None]]:
    """What the job reads at its start, for `launch submit` to check before queueing: (flag, path,
    the check of it where it exists on the submitting machine)."""
    if not cfg.data:
        return []
    return [("--data", cfg.data, _extraction_dir if cfg.mode == "offline" else not_a_directory("--data"))]


def gpu_work(cfg: DFlashConfig) -> str | None:
    """What in this run needs a real GPU, or None when it runs on the CPU too (offline, or online
    with the tiny random target: its GPUs are then only the k-m topology's task count)."""
    if cfg.mode != "online" or (cfg.preset == "tiny" and not cfg.init_from):
        return None
    return f"the online target {cfg.init_from or cfg.preset}"
