"""DFlash drafter training: offline from extraction shards, or online with k target ranks.

`python -m train.dflash --mode offline --data <extraction dir>` or
`python -m train.dflash --mode online --topology 2-1` (world size k+1), behind the Slurm guard;
`main(argv, guard=False)` only for tests.

One step: a bucketed-shuffle batch (train.common.bucketing; new compositions every epoch) ->
anchors sampled per row (seeded by step) -> the drafter predicts the block after each anchor ->
weighted CE on the true tokens (+ optional KL to the verifier), with logits ONLY at the anchor
blocks: drafter slots and the target's gathered final hidden states go through the frozen lm_head,
never a [batch, seq, vocab] tensor.

Files under --out (default $LAUNCH_JOB_DIR): metrics.jsonl, checkpoints/ (drafter + optimizer,
resumed from on a re-run with the same argv), drafter.pt (final weights + config), summary.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from launch.fsutil import atomic_write_text
from train.common.bucketing import BucketedSampler
from train.common.checkpoint import CheckpointError, CheckpointManager
from train.common.distributed import init_distributed, shutdown_distributed
from train.common.entrypoint import run_entrypoint
from train.common.fastpath import FastPathError
from train.common.metrics import MetricsLogger
from train.dflash.data import ShardDataset, batch_stream, pad_samples
from train.dflash.model import (
    Drafter,
    DrafterConfig,
    TargetHead,
    TargetShape,
    block_inputs,
    default_drafter,
    drafter_config,
    drafter_loss,
    gather_block_positions,
    sample_anchors,
)
from train.dflash.online import BoundedSender, parse_topology, recv_batch
from train.extract.data import DatasetError, TokenData, generate_synthetic
from train.extract.shards import ShardError

ENTRYPOINT = "train.dflash"


@dataclass
class DFlashConfig:
    mode: str = "offline"  # offline | online
    data: str | None = None  # offline: extraction dir; online: jsonl (None: synthetic in <out>/data.jsonl)
    topology: str = "2-1"  # online: k target ranks - 1 drafter rank
    preset: str = "tiny"  # online: the target's stage-1 preset
    init_from: str | None = None  # online: local checkpoint of the target
    layers: str | None = None  # online: captured target layers (default: n_layers spread over 1..L-3)
    n_layers: int = 5
    tokenizer: str | None = None  # online: the target's tokenizer dir, for conversations (default: --init-from)
    # drafter preset (target: 5 layers shaped like the target; tiny) or JSON file of DrafterConfig
    # fields; auto: tiny for the tiny target, target otherwise
    drafter: str = "auto"
    block_size: int = 16
    anchors: int = 512  # anchors per sequence (SpecForge's default), clamped to the response positions
    max_bad_fraction: float = 0.01  # offline: shards that fail verification may be skipped up to this share
    steps: int = 40
    token_budget: int = 2048  # padded tokens per batch
    max_len: int = 8192  # online: samples are cut to this many tokens
    lr: float = 3e-3
    warmup: int = 4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    gamma: float | None = 7.0  # slot loss weights exp(-(j-1)/gamma); 0 = uniform
    kl_weight: float = 0.0  # weight of KL(verifier || drafter) on the anchor blocks
    queue_depth: int = 4  # online: messages in flight per target rank
    seed: int = 0
    synthetic_samples: int = 160
    out: str = field(default_factory=lambda: os.environ.get("LAUNCH_JOB_DIR") or "./runs/dflash-local")
    ckpt_every: int = 50
    log_every: int = 1
    allow_slow_path: bool = False
    # Matmuls of the drafter step in bf16 under autocast, fp32 weights and optimizer. auto: on
    # CUDA (an fp32 drafter was the bottleneck of the 1-1 topology on H200s), off on CPU.
    amp: str = "auto"  # auto | bf16 | off


class ConfigError(ValueError):
    pass


def parse_args(argv: list[str] | None) -> DFlashConfig:
    d = DFlashConfig()
    p = argparse.ArgumentParser(prog="python -m train.dflash", description="DFlash drafter training")
    for name, value in asdict(d).items():
        flag = "--" + name.replace("_", "-")
        if name == "allow_slow_path":
            p.add_argument(flag, action="store_true")
        elif name == "mode":
            p.add_argument(flag, choices=("offline", "online"), default=value)
        elif name == "amp":
            p.add_argument(flag, choices=("auto", "bf16", "off"), default=value)
        else:
            kind = {int: int, float: float}.get(type(value), str)
            p.add_argument(flag, type=float if name == "gamma" else kind, default=value)
    cfg = DFlashConfig(**vars(p.parse_args(argv)))
    if cfg.mode == "offline" and not cfg.data:
        raise ConfigError("--mode offline needs --data <extraction dir> (from `launch submit extract`)")
    for name in ("steps", "anchors", "token_budget", "ckpt_every", "log_every", "queue_depth"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
    if not 0.0 <= cfg.max_bad_fraction <= 1.0:
        raise ConfigError(f"--max-bad-fraction must lie in [0, 1], got {cfg.max_bad_fraction}")
    if not (cfg.lr > 0 and math.isfinite(cfg.lr)):
        raise ConfigError(f"--lr must be a positive number, got {cfg.lr}")
    if cfg.mode == "online":
        try:
            parse_topology(cfg.topology)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    return cfg


def main(argv: list[str] | None = None, guard: bool = True) -> int:
    return run_entrypoint(ENTRYPOINT, argv, parse=parse_args, run=train, guard=guard,
                          config_errors=(ConfigError,),
                          run_errors=(ShardError, DatasetError, CheckpointError, ConfigError, FastPathError, ValueError))


def lr_at(cfg: DFlashConfig, step: int) -> float:
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    t = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))


def step_generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


# ---------------------------------------------------------------------------------------------
# the target side (online mode): frozen base model, hooks, anchors, gathered final states


def build_target(cfg: DFlashConfig, device: torch.device):
    from train.common import fastpath
    from train.extract.extract import HiddenCapture, parse_layers
    from train.stage1.model import build_model

    kernels = fastpath.select_kernels(device, allow_slow_path=cfg.allow_slow_path)
    torch.manual_seed(cfg.seed)  # the same random-init target on every rank
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, spec = build_model(cfg.preset, device=device, dtype=dtype, init_from=cfg.init_from)
    fastpath.install_kernels(model, kernels)
    model.eval().requires_grad_(False)
    layers = parse_layers(cfg.layers, model.config.num_hidden_layers, cfg.n_layers)
    return model, spec, layers, HiddenCapture(model.model, layers)


def target_batch(model, capture, samples: list[np.ndarray], cfg: DFlashConfig, step: int,
                 device: torch.device, masks: list[np.ndarray] | None = None) -> dict[str, torch.Tensor]:
    """What a target rank sends for one step: context, anchors and final states at the anchor blocks."""
    from train.extract.extract import pad_batch, target_forward

    ids, lens = pad_batch(samples)
    loss_mask = pad_masks(masks, ids.shape[1]) if masks is not None else torch.ones_like(ids, dtype=torch.bool)
    hidden, final = target_forward(model.model, capture, ids.to(device))
    lengths = torch.tensor(lens)
    anchors = sample_anchors(lengths, cfg.anchors, cfg.block_size, step_generator(cfg.seed, step), loss_mask)
    final_blocks = gather_block_positions(final, anchors.to(final.device), cfg.block_size)
    # Sent as fp32 (the drafter trains in fp32 on CPU; a bf16 wire format is a possible saving on GPUs).
    return {"input_ids": ids, "lengths": lengths, "hidden": hidden.float(), "anchors": anchors,
            "final_blocks": final_blocks.float(), "loss_mask": loss_mask.long()}


def load_online_dataset(cfg: DFlashConfig, vocab_base: int, vocab: int, is_main: bool, barrier) -> TokenData:
    from train.extract.extract import load_token_data

    path = Path(cfg.data) if cfg.data else Path(cfg.out) / "data.jsonl"
    if not cfg.data and not path.exists() and is_main:
        generate_synthetic(path, cfg.synthetic_samples, seed=cfg.seed, vocab=vocab_base)
    barrier()
    data = load_token_data(cfg, path, vocab)  # type: ignore[arg-type]: reads tokenizer, init_from, max_len
    if data.truncated and is_main:
        print(data.report(cfg.max_len), flush=True)
    return data


def pad_masks(masks: list[np.ndarray], width: int) -> torch.Tensor:
    out = torch.zeros(len(masks), width, dtype=torch.bool)
    for r, m in enumerate(masks):
        out[r, : len(m)] = torch.from_numpy(m.astype(bool))
    return out


def make_drafter_config(cfg: DFlashConfig, target: TargetShape, layers: list[int], target_preset: str | None
                        ) -> DrafterConfig:
    spec = default_drafter(target_preset) if cfg.drafter == "auto" else cfg.drafter
    return drafter_config(spec, target, layers, cfg.block_size)


def step_fields(stats: dict) -> str:
    """The DFlash part of the step line: slot-1 accuracy, per-slot accuracies, tau."""
    slots = " ".join("-" if math.isnan(a) else f"{a:.2f}" for a in stats.get("acc_slot", []))
    return f"acc1 {stats['acc_slot'][0]:.3f} | tau {stats['tau']:.2f} | acc/slot {slots}" if stats.get("acc_slot") else ""


# ---------------------------------------------------------------------------------------------


def train(cfg: DFlashConfig) -> int:
    torch.manual_seed(cfg.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    online = cfg.mode == "online"
    dist_info = init_distributed(device, force_group=online)
    if device.type == "cuda":
        device = torch.device("cuda", dist_info.local_rank)
    n_targets = parse_topology(cfg.topology) if online else 0
    if online and dist_info.world_size != n_targets + 1:
        raise ConfigError(f"--topology {cfg.topology} needs {n_targets + 1} ranks, this job has "
                          f"{dist_info.world_size}; set the job's GPUs/tasks to {n_targets + 1}")
    if not online and dist_info.world_size > 1:
        raise ConfigError(f"--mode offline trains one drafter on one rank; this job has {dist_info.world_size} "
                          "tasks (use the `offline` preset, or --gpus-per-node 1)")
    drafter_rank = n_targets if online else 0
    is_drafter = dist_info.rank == drafter_rank
    barrier = torch.distributed.barrier if online else (lambda: None)
    wire = device if dist_info.backend == "nccl" else torch.device("cpu")  # where sent/received tensors live
    out = Path(cfg.out)
    log = MetricsLogger(out, enabled=is_drafter, tensorboard=False)

    # The data and the target's head: from the shards (offline) or the live target (online).
    target = None
    if online:
        target, spec, layers, capture = build_target(cfg, device)
        records = load_online_dataset(cfg, spec.vocab.base_vocab, target.config.vocab_size, dist_info.is_main,
                                      barrier)
        samples = records.ids
        lengths = np.array([len(s) for s in samples])
        target_shape, target_preset = TargetShape.from_config(target.config), cfg.preset
        embed_w, head_w = target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()
        data = None
    else:
        data = ShardDataset(cfg.data, cfg.max_bad_fraction, report=print if is_drafter else (lambda line: None))
        lengths, layers = data.lengths, data.layers
        embed_w, head_w = data.head_weights()
        target_shape, target_preset = data.target_shape(embed_w.shape[0]), data.meta.get("preset")
    sampler = BucketedSampler(lengths, cfg.token_budget, seed=cfg.seed)
    dcfg = make_drafter_config(cfg, target_shape, layers, target_preset)

    ckpts = CheckpointManager(out / "checkpoints", keep=2)
    latest = ckpts.latest()
    start = int(latest.name.split("_")[1]) if latest is not None else 0
    barrier()  # every rank has read the start step before the drafter may write a newer checkpoint

    if online and not is_drafter:
        del embed_w, head_w
        sender = BoundedSender(drafter_rank, cfg.queue_depth, wire)
        t0, produce_s = time.perf_counter(), []
        for step, _epoch, ids in batch_stream(sampler, start):
            if step >= cfg.steps:
                break
            if step % n_targets == dist_info.rank:
                t_batch = time.perf_counter()
                batch = target_batch(target, capture, [samples[i] for i in ids], cfg, step, device,
                                     [records.loss_masks[i] for i in ids])
                if device.type == "cuda":
                    # also waits for sends the drafter has not received: the target's own time
                    # only while the drafter keeps up (bench/multigpu.py checks the drafter's wait)
                    torch.cuda.synchronize(device)
                produce_s.append(time.perf_counter() - t_batch)
                sender.send(batch)
        sender.close()
        # median time to produce a batch: with k targets the drafter saturates once k exceeds
        # (this / the drafter's compute time per step); bench/multigpu.py reads this line.
        median = float(np.median(produce_s)) if produce_s else 0.0
        print(f"# target rank {dist_info.rank}: sent {len(produce_s)} batches in {time.perf_counter() - t0:.1f}s, "
              f"queue full {sender.waits} times, median {median:.4f}s to produce one", flush=True)
        barrier()
        shutdown_distributed(dist_info)
        return 0

    # The drafter rank.
    head = TargetHead(embed_w.to(device), head_w.to(device)).to(device)
    del target
    drafter = Drafter(dcfg).to(device)
    drafter.match_output_scale(head.lm_head.weight)
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(cfg, s))
    if latest is not None:
        state = torch.load(latest / "drafter.pt", map_location=device, weights_only=False)
        drafter.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        log.print(f"# resumed from {latest} at step {start}")
    n_params = sum(p.numel() for p in drafter.parameters())
    amp_on = cfg.amp == "bf16" or (cfg.amp == "auto" and device.type == "cuda")
    log.header({"mode": cfg.mode, "topology": cfg.topology if online else "-", "drafter_params": n_params,
                "target_layers": layers, "block_size": dcfg.block_size, "anchors": cfg.anchors,
                "buckets": sampler.edges, "bucket_efficiency": f"{sampler.stats(0).efficiency:.3f}",
                "start_step": start, "steps": cfg.steps, "device": device.type,
                "amp": "bf16" if amp_on else "off"})

    stream = batch_stream(sampler, start)
    first = last = None
    t_start = time.perf_counter()
    real_tokens = 0
    step = start
    while step < cfg.steps:
        t0 = time.perf_counter()
        s, epoch, ids = next(stream)
        assert s == step
        if online:
            batch = recv_batch(step % n_targets, wire)
            final_blocks = batch["final_blocks"].to(device)
        else:
            batch = data.batch(ids)
            if batch is None:  # every sample of this step is in a skipped shard (reported once)
                step += 1
                continue
            batch["anchors"] = sample_anchors(batch["lengths"], cfg.anchors, cfg.block_size,
                                              step_generator(cfg.seed, step), batch["loss_mask"])
            final_blocks = gather_block_positions(batch["final"], batch["anchors"], cfg.block_size).to(device)
        t_data = time.perf_counter()
        input_ids, anchors = batch["input_ids"].to(device), batch["anchors"].to(device)
        blocks, labels = block_inputs(input_ids, anchors, dcfg.block_size, dcfg.mask_token_id,
                                      batch["loss_mask"].to(device))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp_on):
            hidden = drafter(batch["hidden"].to(device), head.embed_tokens(blocks), anchors,
                             batch["lengths"].to(device))
            loss, stats = drafter_loss(head, hidden, labels, final_blocks, cfg.kl_weight, cfg.gamma or None)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        step += 1
        loss_value = float(loss.detach())
        first = loss_value if first is None else first
        last = loss_value
        n_real = int(batch["lengths"].sum())
        real_tokens += n_real
        t_end = time.perf_counter()
        if step % cfg.log_every == 0 or step == cfg.steps:
            log.log_step({"step": step, "loss": loss_value, "task_loss": {}, "epoch": epoch, **stats,
                          "tok_s": n_real / (t_end - t0), "data_ms": 1000 * (t_data - t0),
                          "compute_ms": 1000 * (t_end - t_data), "batch_rows": len(ids),
                          "padding_efficiency": n_real / batch["input_ids"].numel(), "lr": sched.get_last_lr()[0],
                          "anchors": int((anchors >= 0).sum())}, line_extra=step_fields(stats))
        if step % cfg.ckpt_every == 0 or step == cfg.steps:
            save_checkpoint(ckpts, step, drafter, opt, sched, cfg)
    drafter.save(out / ".drafter.pt.tmp")
    os.replace(out / ".drafter.pt.tmp", out / "drafter.pt")
    summary = {"mode": cfg.mode, "steps": step, "first_loss": first, "last_loss": last,
               "real_tok_s": real_tokens / max(1e-9, time.perf_counter() - t_start),
               "drafter": str((out / "drafter.pt").resolve()), "drafter_params": n_params}
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=1) + "\n")
    log.print(f"# done: {json.dumps(summary)}")
    log.close()
    barrier()
    shutdown_distributed(dist_info)
    return 0


def save_checkpoint(ckpts: CheckpointManager, step: int, drafter: Drafter, opt, sched, cfg: DFlashConfig) -> None:
    def write(tmp: Path) -> None:
        torch.save({"model": drafter.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                    "config": asdict(cfg), "drafter_config": asdict(drafter.cfg), "step": step}, tmp / "drafter.pt")

    ckpts.save(step, write, is_main=True)


__all__ = ["DFlashConfig", "main", "pad_samples"]
