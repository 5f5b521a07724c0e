"""DFlash drafter training: offline from extraction shards, or online with k target ranks.

`python -m train.dflash --mode offline --data <extraction dir>` or
`python -m train.dflash --mode online --topology 2-1` (world size k+m: k target ranks, m drafter
ranks, data-parallel with their gradients all-reduced), behind the Slurm guard;
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

import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from toolkit.metrics import DFLASH_LEGEND, SCHEMAS
from train.common import fastpath
from train.common.bucketing import BucketedSampler
from train.common.checkpoint import CheckpointManager, load_state
from train.common.config import ConfigError
from train.common.distributed import slurm_layout
from train.common.entrypoint import run_entrypoint
from train.common.fastpath import FastPathError
from train.common.losses import LossImplError
from train.common.profiler import ProgressWatch, StepTiming
from train.common.regional_compile import compile_enabled
from train.common.runtime import Runtime
from train.common.stepper import Stepper
from train.dflash.args import DFlashConfig, check_layout, check_tasks, parse_args  # noqa: F401 - the flags live there (no torch)
from train.dflash.data import ShardDataset, batch_stream, pad_samples
from train.dflash.model import (
    Drafter,
    DrafterConfig,
    TargetHead,
    TargetShape,
    block_inputs,
    block_predecessors,
    default_drafter,
    default_gamma,
    default_loss_impl,
    drafter_config,
    drafter_loss,
    gather_block_positions,
    sample_anchors,
)
from train.dflash.online import BoundedSender, recv_batch
from train.extract.data import DatasetError, TokenData, generate_synthetic
from train.extract.shards import ShardError
from train.extract.target import TargetError

ENTRYPOINT = "train.dflash"


def main(argv: list[str] | None = None, guard: bool = True) -> int:
    return run_entrypoint(ENTRYPOINT, argv, parse=parse_args, run=train, guard=guard,
                          run_errors=(ShardError, DatasetError, FastPathError, TargetError, LossImplError, ValueError))


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
    """The target as its checkpoint is (train.extract.target), its captured layers and their hooks."""
    from train.common import fastpath
    from train.extract.extract import HiddenCapture, parse_layers
    from train.extract.target import load_target

    kernels = fastpath.select_kernels(device, allow_slow_path=cfg.allow_slow_path)
    target = load_target(cfg.init_from, cfg.preset, device, cfg.target_dtype, cfg.seed)
    fastpath.install_kernels(target.base, kernels)
    layers = parse_layers(cfg.layers, target.config.num_hidden_layers, cfg.n_layers)
    return target, layers, HiddenCapture(target.base, layers)


def target_batch(base, capture, samples: list[np.ndarray], cfg: DFlashConfig, step: int,
                 device: torch.device, masks: list[np.ndarray] | None = None) -> dict[str, torch.Tensor]:
    """What a target rank sends for one step: context, anchors (on loss-masked response tokens),
    the loss mask, and the final states at the anchor blocks."""
    from train.extract.extract import pad_batch, target_forward

    ids, lens = pad_batch(samples)
    loss_mask = pad_masks(masks, ids.shape[1]) if masks is not None else torch.ones_like(ids, dtype=torch.bool)
    hidden, final = target_forward(base, capture, ids.to(device))
    lengths = torch.tensor(lens)
    anchors = sample_anchors(lengths, cfg.anchors, cfg.block_size, step_generator(cfg.seed, step), loss_mask)
    final_blocks = gather_block_positions(final, anchors.to(final.device), cfg.block_size)
    # Sent as fp32 (the drafter trains in fp32 on CPU; a bf16 wire format is a possible saving on GPUs).
    return {"input_ids": ids, "lengths": lengths, "hidden": hidden.float(), "anchors": anchors,
            "final_blocks": final_blocks.float(), "loss_mask": loss_mask.long()}


def load_online_dataset(cfg: DFlashConfig, vocab: int, is_main: bool, barrier) -> TokenData:
    """Token ids and loss masks (conversations through the target's tokenizer); truncation reported."""
    from train.extract.extract import load_token_data

    path = Path(cfg.data) if cfg.data else Path(cfg.out) / "data.jsonl"
    if not cfg.data and not path.exists() and is_main:
        generate_synthetic(path, cfg.synthetic_samples, seed=cfg.seed, vocab=vocab)
    barrier()
    data = load_token_data(cfg, path, vocab)  # reads cfg.tokenizer, cfg.init_from, cfg.max_len
    if data.truncated and is_main:
        print(data.report(cfg.max_len), flush=True)
    return data


def pad_masks(masks: list[np.ndarray], width: int) -> torch.Tensor:
    out = torch.zeros(len(masks), width, dtype=torch.bool)
    for r, m in enumerate(masks):
        out[r, : len(m)] = torch.from_numpy(m.astype(bool))
    return out


def make_drafter_config(cfg: DFlashConfig, target: TargetShape, layers: list[int], mask_token_id: int,
                        identity: tuple[str, str] = ("", "")) -> DrafterConfig:
    """`--drafter auto`: the published layout for real targets, tiny for test-sized ones."""
    spec = default_drafter(target) if cfg.drafter == "auto" else cfg.drafter
    dcfg = drafter_config(spec, target, layers, cfg.block_size)
    dcfg.mask_token_id = mask_token_id
    dcfg.target, dcfg.target_config_sha256 = identity
    # A JSON file may set any field; these must be the data's, or the first step fails on shapes.
    given = {"target_layer_ids": (dcfg.target_layer_ids, list(layers)), "hidden_size": (dcfg.hidden_size,
             target.hidden_size), "vocab_size": (dcfg.vocab_size, target.vocab_size)}
    for name, (got, want) in given.items():
        if got != want:
            raise ConfigError(f"--drafter {cfg.drafter}: {name} {got}, but the target's hidden states have "
                              f"{want}; leave it out of the file (it is taken from the target)")
    return dcfg


def check_lengths(cfg: DFlashConfig, lengths: np.ndarray, say) -> None:
    """An anchor needs a context state before it and a label after it (positions 1 .. len-2; the
    block may run past the row's end): refuse data where none fits; say so when --anchors
    exceeds what the longest sample offers."""
    longest = int(lengths.max()) if len(lengths) else 0
    room = longest - 2  # anchor positions 1 .. len - 2
    if room < 1:
        raise ConfigError(f"the longest sample has {longest} tokens: no anchor fits (an anchor needs a token "
                          "before it and one after it)")
    if cfg.anchors > room:
        say(f"# --anchors {cfg.anchors}: the longest sample offers at most {room} anchor positions; "
            "each row takes what its response tokens offer")


# ---------------------------------------------------------------------------------------------


@dataclass
class Source:
    """Where batches come from: the shards (offline) or the live target (online, target ranks)."""

    lengths: np.ndarray
    layers: list[int]
    hidden_size: int
    embed_w: torch.Tensor
    head_w: torch.Tensor
    target_shape: TargetShape | None = None  # what the drafter takes from the target's config
    tokenizer: str | None = None  # the target's tokenizer dir, when known (the mask token is one of its ids)
    identity: tuple[str, str] = ("", "")  # (target checkpoint or random:<shape>, its config.json's sha256)
    data: ShardDataset | None = None
    target: Any = None
    capture: Any = None
    samples: list[np.ndarray] | None = None
    loss_masks: list[np.ndarray] | None = None


@dataclass
class DrafterRun:
    head: TargetHead
    drafter: Drafter
    dcfg: DrafterConfig
    stepper: Stepper
    stream: Any
    amp_on: bool
    n_targets: int
    wire: torch.device
    data: ShardDataset | None
    attn_impl: str = "dense"
    loss_impl: str = "logits"
    t_start: float = field(default_factory=time.perf_counter)
    progress: ProgressWatch = field(default_factory=lambda: ProgressWatch(0))
    real_tokens: int = 0
    first: float | None = None
    last: float | None = None
    n_drafters: int = 1  # data-parallel drafter ranks; this one is drafter `index` of them
    index: int = 0
    group: Any = None  # the drafter ranks' process group (their gradients' all-reduce), when m > 1


def micro_batches(sampler: BucketedSampler, start: int, n_drafters: int, index: int):
    """(step, epoch, ids) of drafter `index` of `n_drafters`: step s takes the stream's batch
    s * n_drafters + index (one drafter: the stream itself)."""
    for i, epoch, ids in batch_stream(sampler, start * n_drafters):
        if i % n_drafters == index:
            yield i // n_drafters, epoch, ids


def train(cfg: DFlashConfig) -> int:
    """setup -> steps -> finish on the shared runtime; online target ranks only produce batches."""
    online = cfg.mode == "online"
    if online and cfg.topology == "auto":
        return plan_only(cfg)
    n_targets, n_drafters = check_layout(cfg, slurm_layout()[1])  # before a process group is formed for a wrong layout
    with Runtime.start(ENTRYPOINT, SCHEMAS["dflash"], cfg.out, force_group=online, log_rank=None,
                       tensorboard=False, max_bad_steps=cfg.max_bad_steps) as rt:
        wire = rt.device if rt.dist.backend == "nccl" else torch.device("cpu")  # where sent tensors live
        # The drafter's kernels before any data or model is loaded: a fallback from the GPU locks'
        # fast path (no fused loss kernel) is refused here in one line unless --allow-slow-path.
        # Target ranks check theirs (GDN, conv) in build_target.
        is_drafter = rt.dist.rank >= n_targets
        kernels = drafter_kernels(cfg, rt.device) if is_drafter else None
        # every rank takes part in creating a group; only the drafters use theirs
        group = torch.distributed.new_group(list(range(n_targets, n_targets + n_drafters))) if n_drafters > 1 else None
        src = load_source(cfg, rt, is_drafter)
        check_lengths(cfg, src.lengths, rt.print)
        sampler = BucketedSampler(src.lengths, cfg.token_budget, seed=cfg.seed)
        _, latest = rt.checkpoints(keep=2, restart=cfg.restart)
        start = int(latest.name.split("_")[1]) if latest is not None else 0
        if not is_drafter:
            run_target_rank(cfg, rt, src, sampler, start, n_targets, n_drafters, wire)
            return 0
        assert kernels is not None
        run = setup_drafter(cfg, rt, src, sampler, latest, start, n_targets, wire, kernels)
        run.n_drafters, run.index, run.group = n_drafters, rt.dist.rank - n_targets, group
        run.stream = micro_batches(sampler, start, n_drafters, run.index)
        if group is not None:  # the drafters start from one set of weights (the first drafter's)
            for t in run.drafter.state_dict().values():
                torch.distributed.broadcast(t, n_targets, group=group)
        while rt.step < cfg.steps:
            t0 = time.perf_counter()
            s, epoch, ids = next(run.stream)
            assert s == rt.step
            batch, final_blocks = next_batch(cfg, run, rt.step, ids, rt.device)
            if batch is None:  # every sample of this step is in a skipped shard (reported once)
                rt.step += 1
                continue
            t_data = time.perf_counter()
            loss, stats = drafter_forward(cfg, run, batch, final_blocks, rt.device)
            run.stepper.backward(loss)
            if run.group is not None:
                all_reduce_grads(run)
            grad_norm, skipped = run.stepper.step(loss)
            rt.step += 1
            loss_value = float(loss.detach())
            rt.check_finite(loss_value, grad_norm, skipped)
            run.first = loss_value if run.first is None else run.first
            run.last = loss_value
            n_real = int(batch["lengths"].sum())
            run.real_tokens += n_real
            t_end = time.perf_counter()
            # steps_total, eta_s (and a stall's cause): the compact step line's n/N and ETA, and what
            # `launch status` and the follow's heartbeat say
            progress = run.progress.observe(rt.step, StepTiming(1000 * (t_data - t0), 1000 * (t_end - t_data), n_real))
            if rt.step % cfg.log_every == 0 or rt.step == cfg.steps:
                rt.log.log_step({"step": rt.step, "loss": loss_value, "epoch": epoch, **stats, **progress,
                                 "tok_s": n_real / (t_end - t0), "data_ms": 1000 * (t_data - t0),
                                 "compute_ms": 1000 * (t_end - t_data), "batch_rows": len(ids),
                                 "padding_efficiency": n_real / batch["input_ids"].numel(),
                                 "lr": run.stepper.lr, "grad_norm": grad_norm})
            if (rt.step % cfg.ckpt_every == 0 or rt.step == cfg.steps) and rt.is_logger:
                rt.last_checkpoint = save_checkpoint(rt.ckpts, rt.step, run.drafter, run.stepper.optimizer,
                                                     run.stepper.scheduler, cfg)
        finish(cfg, run, rt)
    return 0


def all_reduce_grads(run: DrafterRun) -> None:
    """Data-parallel drafters: every rank's gradients become the mean over the drafter ranks (the
    same on each, so the same clipped update keeps their weights equal)."""
    for param in run.drafter.parameters():
        if param.grad is not None:
            torch.distributed.all_reduce(param.grad, group=run.group)
            param.grad /= run.n_drafters


def plan_only(cfg: DFlashConfig) -> int:
    """--topology auto: the job's last rank (the drafter's, whose log `launch logs` shows) probes on
    its GPU and prints the plan (train.dflash.plan); the other ranks have nothing to do."""
    from train.dflash.plan import plan_topology

    rank, world, local_rank, _addr, _port = slurm_layout()
    if rank != world - 1:
        return 0
    device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    plan_topology(cfg, cfg.plan_gpus or world, device, Path(cfg.out), sys.modules[__name__])
    return 0


def load_source(cfg: DFlashConfig, rt: Runtime, is_drafter: bool = True) -> Source:
    """The data and the target's head: from the shards (offline) or the live target (online)."""
    if cfg.mode != "online":
        data = ShardDataset(cfg.data, cfg.max_bad_fraction, report=rt.print)
        embed_w, head_w = data.head_weights()
        target = data.target_shape(embed_w.shape[0])
        data.check_target(target)
        meta = data.meta
        return Source(data.lengths, data.layers, data.hidden_size, embed_w, head_w, target,
                      cfg.tokenizer or meta.get("tokenizer") or meta.get("init_from"),
                      (meta.get("target") or meta.get("init_from") or f"random:{meta.get('preset')}",
                       meta.get("target_config_sha256") or ""), data=data)
    from train.extract.extract import parse_layers
    from train.extract.target import checkpoint_config, checkpoint_head, head_weights

    base = capture = None
    if is_drafter and cfg.init_from:  # a drafter rank needs the target's config and head, not the model
        text = checkpoint_config(cfg.init_from)
        layers = parse_layers(cfg.layers, text.num_hidden_layers, cfg.n_layers)
        embed_w, head_w = checkpoint_head(cfg.init_from)
    else:
        target, layers, capture = build_target(cfg, rt.device)
        text, base = target.config, target.base
        embed_w, head_w = head_weights(target)
    records = load_online_dataset(cfg, int(embed_w.shape[0]), rt.dist.is_main, rt.barrier)
    digest = target_identity(cfg.init_from) if cfg.init_from else ""
    return Source(np.array([len(s) for s in records.ids]), layers, text.hidden_size, embed_w, head_w,
                  TargetShape.from_config(text), cfg.tokenizer or cfg.init_from,
                  (cfg.init_from or f"random:{cfg.preset}", digest), target=base, capture=capture, samples=records.ids, loss_masks=records.loss_masks)


def run_target_rank(cfg: DFlashConfig, rt: Runtime, src: Source, sampler: BucketedSampler, start: int,
                    n_targets: int, n_drafters: int, wire: torch.device) -> None:
    """An online target rank: its share of the steps' batches, each sent to the drafter rank that
    trains on it (batch i of the stream: target i % k, drafter k + i % m, its step i // m)."""
    senders = [BoundedSender(n_targets + j, cfg.queue_depth, wire) for j in range(n_drafters)]
    t0, produce_s = time.perf_counter(), []
    for i, _epoch, ids in batch_stream(sampler, start * n_drafters):
        step = i // n_drafters
        if step >= cfg.steps:
            break
        rt.step = step
        if i % n_targets == rt.dist.rank:
            t_batch = time.perf_counter()
            batch = target_batch(src.target, src.capture, [src.samples[j] for j in ids], cfg, i, rt.device,
                                 [src.loss_masks[j] for j in ids])
            if rt.device.type == "cuda":
                # also waits for sends the drafter has not received: the target's own time
                # only while the drafter keeps up (bench/multigpu.py checks the drafter's wait)
                torch.cuda.synchronize(rt.device)
            produce_s.append(time.perf_counter() - t_batch)
            senders[i % n_drafters].send(batch)
    for sender in senders:
        sender.close()
    # median time to produce a batch: with k targets the drafter saturates once k exceeds
    # (this / the drafter's compute time per step); bench/multigpu.py reads this line.
    median = float(np.median(produce_s)) if produce_s else 0.0
    print(f"# target rank {rt.dist.rank}: sent {len(produce_s)} batches in {time.perf_counter() - t0:.1f}s, "
          f"queue full {sum(s.waits for s in senders)} times, median {median:.4f}s to produce one", flush=True)
    rt.barrier()


def drafter_kernels(cfg: DFlashConfig, device: torch.device) -> fastpath.KernelChoice:
    """The drafter rank's kernel set: its loss (no GDN layers run there). onepass is the drafter's
    own frozen-head loss (train.dflash.model._FrozenHeadCE: torch matmuls, no kernel package) and
    `auto`'s choice on CUDA (default_loss_impl)."""
    loss = default_loss_impl(device) if cfg.loss_impl == "auto" else cfg.loss_impl
    if loss == "onepass":
        return replace(fastpath.select_kernels(device, allow_slow_path=cfg.allow_slow_path, loss="logits", gdn=False),
                       loss_impl="onepass")
    return fastpath.select_kernels(device, allow_slow_path=cfg.allow_slow_path, loss=loss, gdn=False)


def setup_drafter(cfg: DFlashConfig, rt: Runtime, src: Source, sampler: BucketedSampler, latest: Path | None,
                  start: int, n_targets: int, wire: torch.device, kernels: fastpath.KernelChoice) -> DrafterRun:
    device = rt.device
    assert src.target_shape is not None
    mask = resolve_mask_token(cfg.mask_token, src.target_shape.vocab_size, src.tokenizer)
    dcfg = make_drafter_config(cfg, src.target_shape, src.layers, mask, src.identity)
    head = TargetHead(src.embed_w.to(device), src.head_w.to(device)).to(device)
    src.target = None  # the drafter rank needs only the target's head
    drafter = Drafter(dcfg).to(device)
    drafter.match_output_scale(head.lm_head.weight)
    if compile_enabled(cfg.compile, device):
        drafter.compile_regions()
    stepper = Stepper.create(drafter, drafter, lr=cfg.lr, weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip,
                             lr_lambda=lambda s: lr_at(cfg, s), device=device, dist=rt.dist, data_parallel=False)
    if latest is not None:
        stepper.load_state_dict(load_state(latest / "drafter.pt", map_location=device), latest)
        rt.print(f"# resumed from {latest} at step {start}")
    rt.step = start
    amp_on = cfg.amp == "bf16" or (cfg.amp == "auto" and device.type == "cuda")
    online = cfg.mode == "online"
    rt.log.header({"mode": cfg.mode, "topology": cfg.topology if online else "-",
                   "drafter_params": sum(p.numel() for p in drafter.parameters()), "target_layers": src.layers,
                   "block_size": dcfg.block_size, "anchors": cfg.anchors, "buckets": sampler.edges,
                   "bucket_efficiency": f"{sampler.stats(0).efficiency:.3f}", "start_step": start,
                   "steps": cfg.steps, "device": device.type, "amp": "bf16" if amp_on else "off",
                   "loss_impl": kernels.loss_impl})
    rt.print("# " + kernels.header().replace("\n", "\n# "))
    rt.print(f"# {DFLASH_LEGEND}")
    from train.dflash.model import default_attn_impl, dense_budget_refusal

    attn = default_attn_impl(device) if cfg.attn_impl == "auto" else cfg.attn_impl
    if attn == "dense" and device.type == "cuda":  # refused here, not by an out-of-memory at step 1
        free, _total = torch.cuda.mem_get_info(device)
        rows = max((len(b) for b in sampler.batches(0)), default=1)
        refusal = dense_budget_refusal(dcfg, cfg.token_budget, cfg.anchors, amp_on, free, rows)
        if refusal:
            raise ConfigError(refusal)
    return DrafterRun(head, drafter, dcfg, stepper, batch_stream(sampler, start), amp_on, n_targets, wire, src.data,
                      attn, kernels.loss_impl or "logits", progress=ProgressWatch(cfg.steps, device))


def next_batch(cfg: DFlashConfig, run: DrafterRun, step: int, ids: Any, device: torch.device
               ) -> tuple[dict[str, torch.Tensor] | None, torch.Tensor | None]:
    """This step's batch and the target's final states at its anchor blocks; (None, None) when
    every sample of the step is in a shard skipped within --max-bad-fraction."""
    if run.data is None:  # online: from the target rank whose turn it is
        batch = recv_batch((step * run.n_drafters + run.index) % run.n_targets, run.wire)
        return batch, batch["final_blocks"].to(device)
    batch = run.data.batch(ids)
    if batch is None:
        return None, None
    batch["anchors"] = sample_anchors(batch["lengths"], cfg.anchors, cfg.block_size, step_generator(cfg.seed, step),
                                      batch["loss_mask"])
    return batch, gather_block_positions(batch["final"], batch["anchors"], cfg.block_size).to(device)


def drafter_forward(cfg: DFlashConfig, run: DrafterRun, batch: dict[str, torch.Tensor], final_blocks: torch.Tensor,
                    device: torch.device) -> tuple[torch.Tensor, dict[str, float]]:
    input_ids, anchors = batch["input_ids"].to(device), batch["anchors"].to(device)
    blocks, labels = block_inputs(input_ids, anchors, run.dcfg.block_size, run.dcfg.mask_token_id,
                                  batch["loss_mask"].to(device), batch["lengths"].to(device))
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=run.amp_on):
        hidden = run.drafter(batch["hidden"].to(device), run.head.embed_tokens(blocks), anchors,
                             batch["lengths"].to(device), attn_impl=run.attn_impl)
        selector = run.drafter.candidate_selector
        loss, stats = drafter_loss(run.head, hidden, labels, final_blocks, cfg.kl_weight, slot_gamma(cfg),
                                   loss_impl=run.loss_impl, selector=selector,
                                   predecessors=block_predecessors(input_ids, anchors, run.dcfg.block_size)
                                   if selector is not None else None, selector_alpha=cfg.selector_alpha,
                                   metric_rows=cfg.acc_rows or None)
    stats["anchors"] = int((anchors >= 0).sum())  # blocks in this step
    return loss, stats


def slot_gamma(cfg: DFlashConfig) -> float | None:
    """The slot-weight decay: --gamma, or the block size's published value; None (uniform) for 0."""
    gamma = cfg.gamma if cfg.gamma is not None else default_gamma(cfg.block_size)
    return gamma or None


# The published Qwen3.5 DFlash configs' mask token (SpecForge configs/qwen3.5-4b-vl-dflash.json,
# qwen3.6-27b-dflash2.json): a reserved special token of the Qwen3.5 tokenizer's 248,320 rows.
QWEN35_VOCAB, QWEN35_MASK = 248320, 248070


def text_vocab(vocab: int, tok) -> int:
    """The rows of the target's text vocabulary: ``vocab``, less the 3D codebook rows a stage-1
    export appends after it (its tokenizer is the base one plus ``<|ss_0|>``... from the base's size
    on; without a tokenizer, a vocab that is exactly Qwen3.5's extended by the default codebooks)."""
    from train.common.codebooks import CodebookVocab, code_token_name

    if tok is not None:
        first_code = tok.convert_tokens_to_ids(code_token_name("ss", 0))
        if first_code is not None and first_code != getattr(tok, "unk_token_id", None) and 0 < first_code < vocab:
            return int(first_code)
        return vocab
    return QWEN35_VOCAB if vocab == CodebookVocab(QWEN35_VOCAB).padded_vocab else vocab


def resolve_mask_token(spec: str, vocab: int, tokenizer_dir: str | None) -> int:
    """The mask token id: `spec` as an id or a token of the target's tokenizer, or (auto) the
    published Qwen3.5 id when the target's text vocabulary is Qwen3.5's (the checkpoint, or a
    stage-1 export of it: the same tokenizer, 3D rows after it), else the tokenizer's pad token,
    else the last row.

    The serving engines embed it with the TARGET's embedding, so it must be one of its rows, and
    when the tokenizer is known, one of its tokens (ConfigError otherwise)."""
    tok = None
    if tokenizer_dir and Path(tokenizer_dir).is_dir():
        from train.common.hf_local import has_tokenizer, load_tokenizer

        tok = load_tokenizer(tokenizer_dir) if has_tokenizer(tokenizer_dir) else None
    if spec == "auto":
        pad = getattr(tok, "pad_token_id", None) if tok is not None else None
        mask = QWEN35_MASK if text_vocab(vocab, tok) == QWEN35_VOCAB else pad if pad is not None else vocab - 1
    elif spec.lstrip("-").isdigit():
        mask = int(spec)
    else:
        if tok is None:
            raise ConfigError(f"--mask-token {spec!r}: a token needs the target's tokenizer (--tokenizer DIR)")
        mask = tok.convert_tokens_to_ids(spec)
        if mask is None or mask == getattr(tok, "unk_token_id", None):
            raise ConfigError(f"--mask-token {spec!r}: not a token of the target's tokenizer {tokenizer_dir}")
    if not 0 <= mask < vocab:
        raise ConfigError(f"--mask-token {spec}: id {mask} is not a row of the target's {vocab}-row embedding")
    if tok is not None and mask >= len(tok):
        raise ConfigError(f"--mask-token {spec}: id {mask} is a padding row, not a token of the target's "
                          f"tokenizer ({len(tok)} tokens)")
    return int(mask)


def target_identity(path: str) -> str:
    """sha256 of the target checkpoint's config.json (named in the export's README)."""
    import hashlib

    return hashlib.sha256((Path(path) / "config.json").read_bytes()).hexdigest()


def finish(cfg: DFlashConfig, run: DrafterRun, rt: Runtime) -> None:
    out = rt.out
    equal = drafters_agree(run) if run.group is not None else None
    if not rt.is_logger:  # another data-parallel drafter: the logging one writes the weights
        rt.barrier()
        return
    if equal is False:
        rt.print(f"# WARNING: the {run.n_drafters} drafter ranks ended with different weights")
    run.drafter.save(out / ".drafter.pt.tmp")
    os.replace(out / ".drafter.pt.tmp", out / "drafter.pt")
    rt.finish({"mode": cfg.mode, "steps": rt.step, "first_loss": run.first, "last_loss": run.last,
               # the one throughput figure: real (non-padding) tokens per second of the drafter
               "real_tok_s": run.real_tokens / max(1e-9, time.perf_counter() - run.t_start),
               "drafter": str((out / "drafter.pt").resolve()),
               "drafter_params": sum(p.numel() for p in run.drafter.parameters()),
               "drafter_ranks": run.n_drafters, **({"drafter_ranks_equal": equal} if equal is not None else {})})
    rt.barrier()


def drafters_agree(run: DrafterRun) -> bool:
    """Whether every drafter rank holds the same weights: each parameter's sum and sum of squares
    (fp64), gathered over the drafter ranks and compared exactly."""
    mine = torch.stack([v for p in run.drafter.parameters() for v in (p.double().sum(), p.double().square().sum())])
    mine = mine.to(run.wire)
    every = [torch.empty_like(mine) for _ in range(run.n_drafters)]
    torch.distributed.all_gather(every, mine, group=run.group)
    return all(torch.equal(e, every[0]) for e in every)


def save_checkpoint(ckpts: CheckpointManager, step: int, drafter: Drafter, opt, sched, cfg: DFlashConfig) -> Path:
    def write(tmp: Path) -> None:
        torch.save({"model": drafter.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                    "config": asdict(cfg), "drafter_config": asdict(drafter.cfg), "step": step}, tmp / "drafter.pt")

    return ckpts.save(step, write, is_main=True)


__all__ = ["DFlashConfig", "main", "pad_samples"]
