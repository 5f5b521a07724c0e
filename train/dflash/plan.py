"""`--topology auto`: choose the k-m split of a node (k target ranks, m drafter ranks) by measurement.

The job's last rank (whose log `launch logs` shows) runs a short probe on its own GPU with the job's target and data, through the
trainer's own code: a target rank's batch (`target_batch`: forward, captured layers, anchors, the
final states at the blocks) and a drafter step on that batch (`drafter_forward`, backward, AdamW).
Every GPU of a node is the same kind, so one GPU's times stand for all of them.

With t_target seconds for a target rank to produce a batch and t_drafter for a drafter rank to
train on one, k target ranks and m data-parallel drafter ranks (each trains on its own batch, the
gradients all-reduced) go through min(k / t_target, m / t_drafter) batches per second. The plan is
the split of at most the node's GPUs with the best rate, the fewest GPUs among those within 2% of
it: one drafter keeps up with t_target / t_drafter targets, so a drafter-bound probe (SpecForge's
8B recipe: 1 capture server, 7 trainers) gets several drafter ranks. The all-reduce of the
drafter's gradients is not in the probe (one GPU): with m > 1 the rate is an upper bound.
Beside it, the offline route: extraction on every GPU, shards on disk (bytes per token x tokens),
then the drafter alone on one GPU.

The other ranks exit at once. The plan is printed (one screen) and written to <out>/plan.json;
the run to submit is the k-m command it names.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from toolkit.fsutil import atomic_write_text

NEAR_BEST = 0.98  # the fewest GPUs within 2% of the best rate


@dataclass
class Probe:
    target_s: float  # median seconds for one target rank to produce one batch
    drafter_s: float  # median seconds for one drafter step on such a batch
    samples_per_batch: float
    tokens_per_batch: float  # real (unpadded) tokens
    bytes_per_token: int  # what an offline shard holds per token
    total_samples: int
    total_tokens: int
    gpus: int
    device: str = ""


@dataclass
class Plan:
    k: int  # target ranks
    m: int  # drafter ranks; the job then has k + m tasks
    samples_s: float  # expected samples/s of the k-m run
    rates: list[tuple[int, int, int, float]]  # per GPU count n: (n, k, m, samples/s) of its best split
    bound: str  # what limits the chosen split: "drafters", "targets" or "both"
    offline_disk_bytes: int
    offline_extract_s: float  # extraction of the whole data on every GPU of the node
    offline_train_samples_s: float  # the drafter alone, from shards


def split_rate(p: Probe, k: int, m: int) -> float:
    """samples/s of k target ranks feeding m drafter ranks."""
    return min(k / p.target_s, m / p.drafter_s) * p.samples_per_batch


def choose(p: Probe) -> Plan:
    """k and m from the measured times (see the module docstring)."""
    if p.gpus < 2:
        raise ValueError(f"a k-m split needs at least 2 GPUs, the node has {p.gpus}")
    best_of: dict[int, tuple[int, int, float]] = {}  # GPUs used -> the best (k, m, rate) on that many
    for n in range(2, p.gpus + 1):
        k, m = max(((k, n - k) for k in range(1, n)), key=lambda km: (split_rate(p, *km), -km[1]))
        best_of[n] = (k, m, split_rate(p, k, m))
    best = max(r for _, _, r in best_of.values())
    n = min(n for n, (_, _, r) in best_of.items() if r >= NEAR_BEST * best)
    k, m, rate = best_of[n]
    feed, train = k / p.target_s, m / p.drafter_s
    bound = "both" if min(feed, train) >= NEAR_BEST * max(feed, train) else ("targets" if feed < train else "drafters")
    batches = p.total_samples / max(p.samples_per_batch, 1e-9)
    return Plan(k=k, m=m, samples_s=rate, rates=[(n, *v) for n, v in sorted(best_of.items())], bound=bound,
                offline_disk_bytes=p.bytes_per_token * p.total_tokens,
                offline_extract_s=batches * p.target_s / p.gpus,
                offline_train_samples_s=p.samples_per_batch / p.drafter_s)


def report(p: Probe, plan: Plan) -> list[str]:
    """The reasoning, one screen."""
    ratio = p.target_s / p.drafter_s
    lines = [
        f"# topology auto: probe on one {p.device or 'device'} (the node has {p.gpus} GPUs)",
        f"#   target rank: {p.target_s:.3f} s per batch ({p.samples_per_batch:.1f} samples, "
        f"{p.tokens_per_batch:,.0f} real tokens)",
        f"#   drafter rank: {p.drafter_s:.3f} s per batch (one step)",
        f"#   k targets and m drafters (data-parallel) go through min(k / {p.target_s:.3f}, m / {p.drafter_s:.3f}) "
        f"batches/s: one drafter keeps up with t_target / t_drafter = {ratio:.2f} targets",
        "#   GPUs | best k-m | samples/s",
    ]
    shown = plan.rates if len(plan.rates) <= 8 else [r for r in plan.rates if abs(r[0] - plan.k - plan.m) <= 3]
    lines += [f"#   {n:>4} | {k:>3}-{m:<3} | {r:,.1f}{'  <- chosen' if (k, m) == (plan.k, plan.m) else ''}"
              for n, k, m, r in shown]
    idle = p.gpus - plan.k - plan.m
    lines += [
        f"# chosen: {plan.k}-{plan.m} on {plan.k + plan.m} GPUs, {plan.samples_s:,.1f} samples/s expected "
        f"(limited by the {plan.bound}{f'; {idle} more GPU(s) add less than 2%' if idle else ''}"
        f"{'; the drafters all-reduce their gradients each step, not in this estimate' if plan.m > 1 else ''})",
        f"# offline route instead: shards of {p.bytes_per_token:,} B/token x {p.total_tokens:,} tokens = "
        f"{size(plan.offline_disk_bytes)} on disk, extraction ~{plan.offline_extract_s / 60:,.1f} min "
        f"on {p.gpus} GPUs, then {plan.offline_train_samples_s:,.1f} samples/s on one drafter GPU",
        f"# run: launch submit dflash --arg topology={plan.k}-{plan.m} --gpus-per-node {plan.k + plan.m}",
    ]
    return lines


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} TiB"


def _median_time(fn, runs: int, warmup: int, device: torch.device) -> tuple[float, list]:
    outs, times = [], []
    for i in range(warmup + runs):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = fn(i)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            outs.append(out)
    return statistics.median(times), outs


def run_probe(cfg, device: torch.device, gpus: int, trainer, batches: int = 3, warmup: int = 1) -> Probe:
    """Times the trainer's own target batch and drafter step on the job's target and data.

    `trainer` is the train.dflash.train module, handed in by its caller (the trainer itself), so
    that this module never imports it back: the probe runs exactly the trainer's functions."""
    from train.common.bucketing import BucketedSampler
    from train.common.regional_compile import compile_enabled
    from train.dflash.model import Drafter, TargetHead, TargetShape, default_attn_impl
    from train.extract.target import head_weights

    T = trainer
    target, layers, capture = T.build_target(cfg, device)
    embed_w, head_w = head_weights(target)
    records = T.load_online_dataset(cfg, int(embed_w.shape[0]), True, lambda: None)
    lengths = np.array([len(s) for s in records.ids])
    plan = BucketedSampler(lengths, cfg.token_budget, seed=cfg.seed).batches(0)
    if not plan:
        raise ValueError("the data gives no batch to probe with")
    picks = [plan[i % len(plan)] for i in range(warmup + batches)]

    def produce(i: int) -> dict[str, torch.Tensor]:
        ids = picks[i]
        return T.target_batch(target.base, capture, [records.ids[j] for j in ids], cfg, i, device,
                              [records.loss_masks[j] for j in ids])

    target_s, made = _median_time(produce, batches, warmup, device)
    shape = TargetShape.from_config(target.config)
    mask = T.resolve_mask_token(cfg.mask_token, shape.vocab_size, cfg.tokenizer or cfg.init_from)
    dcfg = T.make_drafter_config(cfg, shape, layers, mask)
    head = TargetHead(embed_w.to(device), head_w.to(device)).to(device)
    drafter = Drafter(dcfg).to(device)
    if compile_enabled(cfg.compile, device):
        drafter.compile_regions()
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, fused=device.type == "cuda")
    amp_on = cfg.amp == "bf16" or (cfg.amp == "auto" and device.type == "cuda")
    attn = default_attn_impl(device) if cfg.attn_impl == "auto" else cfg.attn_impl
    loss_impl = T.drafter_kernels(cfg, device).loss_impl or "logits"
    run = T.DrafterRun(head, drafter, dcfg, None, None, amp_on, 1, device, None, attn,  # type: ignore[arg-type]
                       loss_impl)
    steps = [made[i % len(made)] for i in range(warmup + batches)]

    def step(i: int) -> None:
        batch = steps[i]
        loss, _ = T.drafter_forward(cfg, run, batch, batch["final_blocks"].to(device), device)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    drafter_s, _ = _median_time(step, batches, warmup, device)
    # an offline shard per token: input_ids (int32), loss mask (1 B), captured layers and final state
    # in extraction's default dtype (bf16)
    item = torch.empty(0, dtype=torch.bfloat16).element_size()
    return Probe(target_s=target_s, drafter_s=drafter_s,
                 samples_per_batch=sum(len(b) for b in picks[warmup:]) / batches,
                 tokens_per_batch=sum(int(lengths[b].sum()) for b in picks[warmup:]) / batches,
                 bytes_per_token=4 + 1 + (len(layers) + 1) * shape.hidden_size * item,
                 total_samples=len(lengths), total_tokens=int(lengths.sum()), gpus=gpus,
                 device=torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU")


def plan_topology(cfg, gpus: int, device: torch.device, out: Path, trainer, say=print) -> Plan:
    probe = run_probe(cfg, device, gpus, trainer)
    plan = choose(probe)
    for line in report(probe, plan):
        say(line)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "plan.json", json.dumps({"probe": asdict(probe), "plan": asdict(plan)}, indent=2) + "\n")
    return plan


__all__ = ["Plan", "Probe", "choose", "plan_topology", "report", "run_probe"]
