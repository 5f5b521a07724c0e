"""DFlash drafter training step, today's dense attention against block-sparse flex_attention, and
the target's extraction forward, on one GPU. Prints markdown tables (bench/RESULTS.md).

    python bench/dflash_drafter.py drafter [--anchors 4,512] [--impls auto|dense:logits,flex:cce,flex:onepass]
        [--steps 6] [--compile on|off] [--target 2b|27b] [--acc-rows 4096]
        (27b: the Qwen3.6-27B shape and its qwen3.6-27b drafter)
    python bench/dflash_drafter.py extract [--steps 4] [--token-budget 65536] [--target 2b|27b]
    (either: [--first-step-limit S --late warn|fail] [--profile on|off] [--device cpu --smoke];
    bench/dflash_h200.sh runs them)

--impls auto is what the trainer runs by default on the device (CUDA: packed block-sparse flex,
the fused loss). The header says the compile's cost: the warm-up steps' seconds, the graphs
dynamo compiled, and when the first step ended after the process start. The accuracy metrics
are measured on --acc-rows rows a step, as the trainer's; the breakdown times the loss with them
over every row beside it. --profile (CUDA, default on): after the timed steps, one drafter step
per implementation and one extraction batch under torch.profiler, GPU time by kernel family and
the top kernels.

Extraction: a batch's time runs from its packing to the end of its forward on the compute stream,
plus the wait for the previous batch's device-to-host copy, which runs beside that forward on a
side stream (as the extractor's); the last copy is waited for in the total. Two warm-up batches
first, so both in-flight batches' pinned host buffers exist. --target 27b runs the Qwen3.6-27B
text stack (random bf16 weights); the 2B run prints the 27B's rate scaled by FLOPs, an estimate.

Workload: a Qwen3.5-2B-shaped target (hidden 2048, 24 layers, vocab 248,320, the model shape
`qwen35-2b` without codebook rows), 5 captured layers, the published `qwen3.5` drafter (5 layers,
32 x 128 query heads, 8 kv heads, MLP 6144), K = 16, bf16 autocast with fp32 weights and fused
AdamW, as the trainer runs it. Conversations of 1-4k tokens from the reference length mix
(train.common.bucketing.long_tail_lengths, median 1,800, clipped to [1024, 4096]), the first
quarter of each the prompt, the rest the response; batches of the bucketed shuffle under
--token-budget padded tokens. Hidden states are random (the drafter's cost does not depend on
their values).

FLOPs (train.common.mfu.drafter_step_flops): drafter layers 6N per block slot and per context
token, attention 12 * heads * head_dim per (query, key) pair by the REAL key counts (anchor prefix
+ own block), the frozen lm_head 4N per labelled slot; MFU against 989 TFLOP/s (bf16 dense).
Extraction: forward only (train.common.mfu.extraction_flops_per_token, no lm_head) per padded
token (all-token MFU) and per real token (useful MFU).

k* projection: ceil(target seconds per batch / drafter seconds per batch), both measured here on
the same batch size: the number of target ranks one drafter rank keeps up with.
"""

from __future__ import annotations

import time

PROCESS_START = time.perf_counter()  # before torch's import: "within N s of the process start"

import argparse  # noqa: E402
import faulthandler  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from train.common.bucketing import BucketedSampler, long_tail_lengths  # noqa: E402
from train.common.mfu import H100_H200_PEAK, drafter_step_flops, extraction_flops_per_token  # noqa: E402
from train.common.shapes import ModelShape  # noqa: E402
from train.dflash.args import DFlashConfig  # noqa: E402
from train.dflash.model import (  # noqa: E402
    Drafter,
    TargetHead,
    TargetShape,
    block_inputs,
    dense_budget_refusal,
    drafter_config,
    drafter_loss,
    sample_anchors,
)

TARGET = TargetShape(hidden_size=2048, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
                     head_dim=256, intermediate_size=6144, vocab_size=248320, rope_theta=1e7)
LAYERS = [1, 6, 11, 16, 21]
K = 16


class FirstStep:
    """The first step's deadline: a LATE line with the main thread's stack when no step has ended
    `limit` s after the process start (where the time goes: a compile, a hang), and exit 3 with
    late="fail"; on the first step's end, the time since the process start."""

    def __init__(self, limit: float, late: str) -> None:
        self.limit, self.late, self.ended = limit, late, None
        self.timer = None
        if limit > 0:
            self.timer = threading.Timer(max(0.0, limit - (time.perf_counter() - PROCESS_START)), self._late)
            self.timer.daemon = True
            self.timer.start()

    def _late(self) -> None:
        print(f"# LATE: no step ended within {self.limit:.0f} s of the process start; the stacks now:", flush=True)
        faulthandler.dump_traceback(file=sys.stdout, all_threads=True)
        sys.stdout.flush()
        if self.late == "fail":
            os._exit(3)

    def done(self, what: str) -> None:
        if self.ended is None:
            self.ended = time.perf_counter() - PROCESS_START
            if self.timer is not None:
                self.timer.cancel()
            print(f"# first step: {what} ended {self.ended:.1f} s after the process started", flush=True)


def compiled_graphs() -> int:
    """Graphs dynamo compiled so far in this process (every recompile counts)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0))


def conversations(n: int, seed: int) -> np.ndarray:
    return np.clip(long_tail_lengths(n, seed=seed, lo=1024, hi=4096, median=1800.0, sigma=0.5), 1024, 4096)


def batches(n_batches: int, budget: int, seed: int) -> list[np.ndarray]:
    lengths = np.minimum(conversations(4 * n_batches * max(1, budget // 1024), seed), budget)  # a small --smoke budget
    got = BucketedSampler(lengths, budget, seed=seed).batches(0)[:n_batches]
    return [lengths[b] for b in got]


def make_batch(lens: np.ndarray, dev: torch.device, gen: torch.Generator, dev_gen: torch.Generator
               ) -> dict[str, torch.Tensor]:
    """A batch: ids and masks on the host (as the trainer's data), the context states drawn on the
    device by `dev_gen` (a host draw of 3 x 16k x 25,600 values took seconds of the first step)."""
    b, t = len(lens), int(lens.max())
    lengths = torch.tensor(lens, dtype=torch.long)
    pos = torch.arange(t)
    mask = (pos[None] >= (lengths[:, None] // 4)) & (pos[None] < lengths[:, None])
    return {"lengths": lengths, "loss_mask": mask,
            "input_ids": torch.randint(0, TARGET.vocab_size, (b, t), generator=gen),
            "hidden": torch.randn(b, t, len(LAYERS) * TARGET.hidden_size, generator=dev_gen, device=dev)}


def real_keys(cfg, anchors: torch.Tensor, lengths: torch.Tensor) -> int:
    """The keys the valid anchors' slots attend, summed over slots, averaged over the layers
    (drafter_step_flops' key_count): a full layer's slot sees the context before its anchor and
    its whole block; slot j of a sliding layer (window W) at most W - 1 - j context positions and
    the slots 0..j of its block (causal there, as the engines serve it)."""
    ctx = torch.minimum(anchors, lengths[:, None]).clamp(min=0)[anchors >= 0][:, None]  # [N, 1]
    j = torch.arange(cfg.block_size)
    total = 0
    for i in range(cfg.num_layers):
        w = cfg.layer_window(i)
        if w is None:
            total += int(((ctx + cfg.block_size) * cfg.block_size).sum())
        else:
            total += int((torch.minimum(ctx, (w - 1 - j).clamp(min=0)) + j + 1).sum())
    return total // cfg.num_layers


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# The trainer's --acc-rows: the accuracy metrics' argmax pass over this many rows of the step
ACC_ROWS = DFlashConfig.acc_rows


def train_step(drafter, head, opt, bt, anchors, blocks, labels, attn: str, loss_impl: str,
               acc_rows: int = ACC_ROWS) -> float:
    """One drafter step as the trainer runs it (bf16 autocast, fp32 weights, the accuracy metrics
    on --acc-rows rows); its seconds."""
    dev = anchors.device
    sync(dev)
    t0 = time.perf_counter()
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        hid = drafter(bt["hidden"], head.embed_tokens(blocks), anchors, bt["lengths"].to(dev), attn_impl=attn)
        loss, _ = drafter_loss(head, hid, labels, None, 0.0, 7.0, loss_impl=loss_impl, metric_rows=acc_rows or None)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync(dev)
    return time.perf_counter() - t0


QWEN36_27B = TargetShape(hidden_size=5120, num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4,
                         head_dim=256, intermediate_size=17408, vocab_size=248320, rope_theta=1e7)


def drafter_bench(args) -> None:
    global TARGET, LAYERS
    dev = torch.device(args.device)
    preset = "qwen3.5"
    if args.target == "27b":
        TARGET, LAYERS, preset = QWEN36_27B, [1, 16, 31, 46, 61], "qwen3.6-27b"
    if args.smoke:  # a CPU check of this script's own logic, tiny shapes
        TARGET = TargetShape(hidden_size=64, num_hidden_layers=24, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16, intermediate_size=128, vocab_size=300)
        preset = "tiny"
    cfg = drafter_config(preset, TARGET, LAYERS, K)
    if args.smoke and args.target == "27b":
        cfg.layer_types, cfg.sliding_window = ["sliding_attention", "full_attention"], 64
    cfg.mask_token_id = TARGET.vocab_size - 250 if args.smoke else 248070
    torch.manual_seed(0)
    dev_gen = torch.Generator(dev).manual_seed(0)
    # weights and the head drawn on the device: on the host, the 27B shapes' ~4.5B random values
    # (drafter init, two 248k x 5,120 head matrices, the head's own Linear init) took ~20 s of the
    # first step, before any of the step's work
    with torch.device(dev):
        drafter = Drafter(cfg)
        head = TargetHead(torch.randn(TARGET.vocab_size, TARGET.hidden_size, generator=dev_gen) * 0.02,
                          torch.randn(TARGET.vocab_size, TARGET.hidden_size, generator=dev_gen) * 0.02)
    if args.compile == "on":
        drafter.compile_regions(dynamic=True if args.dynamic == "on" else None)
    drafter.match_output_scale(head.lm_head.weight)
    opt = torch.optim.AdamW([p for p in drafter.parameters()], lr=1e-4, fused=dev.type == "cuda")
    gen = torch.Generator().manual_seed(0)
    data = [make_batch(lens, dev, gen, dev_gen) for lens in batches(args.batches, args.token_budget, 0)]
    rows, parts_rows, failed, profiles = [], [], [], []
    impls = args.impls
    if impls == "auto":  # the trainer's defaults on this device (train.dflash.train: --attn-impl/--loss-impl auto)
        from train.dflash.model import default_attn_impl, default_loss_impl

        impls = f"{default_attn_impl(dev)}:{default_loss_impl(dev)}"
    watch = FirstStep(args.first_step_limit, args.late)
    print(f"# drafter {preset} (target {args.target}): {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"MLP {cfg.intermediate_size}, windows {[cfg.layer_window(i) for i in range(cfg.num_layers)]}, "
          f"K {K}, vocab {TARGET.vocab_size}; impls {impls}; compile {args.compile} (dynamic {args.dynamic}); "
          f"accuracy metrics on {args.acc_rows or 'all'} rows a step; "
          f"device {dev}", flush=True)
    for n_anchors in [int(x) for x in args.anchors.split(",")]:
        plans = []
        for i, bt in enumerate(data):
            anchors = sample_anchors(bt["lengths"], n_anchors, K, torch.Generator().manual_seed(i), bt["loss_mask"])
            blocks, labels = block_inputs(bt["input_ids"], anchors, K, cfg.mask_token_id, bt["loss_mask"],
                                          bt["lengths"])
            valid = anchors >= 0
            keys = real_keys(cfg, anchors, bt["lengths"])
            flops = drafter_step_flops(cfg, TARGET.vocab_size, int(bt["lengths"].sum()), int(valid.sum()) * K, keys,
                                       int((labels != -100).sum()))
            plans.append((bt, anchors.to(dev), blocks.to(dev), labels.to(dev), flops))
        outs = {}
        for impl in impls.split(","):
            attn, loss_impl = impl.split(":")
            if attn == "dense" and dev.type == "cuda":  # as the trainer: refused up front, not out of memory
                n_rows = max(len(p[0]["lengths"]) for p in plans)
                refusal = dense_budget_refusal(cfg, args.token_budget, n_anchors, True,
                                               torch.cuda.mem_get_info(dev)[0], n_rows)
                if refusal:
                    print(f"# {impl} at {n_anchors} anchors: refused: {refusal}", flush=True)
                    continue

            def step(bt, anchors, blocks, labels, record, attn=attn, loss_impl=loss_impl):
                t = train_step(drafter, head, opt, bt, anchors, blocks, labels, attn, loss_impl, args.acc_rows)
                if record is not None:
                    record.append(t)

            try:  # one implementation failing (a compile, memory) leaves the others' rows and tables
                if dev.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                graphs0, warm = compiled_graphs(), []
                for _ in range(args.warmup):  # every batch shape once per pass: compiles happen here
                    for bt, anchors, blocks, labels, _f in plans:
                        step(bt, anchors, blocks, labels, warm)
                        watch.done(f"{impl} at {n_anchors} anchors")
                if warm:
                    print(f"# compile: {impl} at {n_anchors} anchors: warm-up steps "
                          f"{', '.join(f'{t:.1f}' for t in warm)} s (the first compiles), "
                          f"{compiled_graphs() - graphs0} graphs compiled", flush=True)
                per_batch = [[] for _ in plans]
                for _ in range(args.steps):
                    for j, (bt, anchors, blocks, labels, _f) in enumerate(plans):
                        step(bt, anchors, blocks, labels, per_batch[j])
                mem = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0
                med = [statistics.median(x) for x in per_batch]
                sec = sum(med) / len(med)
                flops = sum(p[4]["total"] for p in plans) / len(plans)
                real = sum(int(p[0]["lengths"].sum()) for p in plans) / len(plans)
                blocks_n = sum(int((p[1] >= 0).sum()) for p in plans) / len(plans)
                attn_share = sum(p[4]["attention"] for p in plans) / sum(p[4]["total"] for p in plans)
                outs[impl] = sec
                rows.append((impl, n_anchors, blocks_n, 1000 * sec, real / sec, flops / 1e12, attn_share,
                             flops / sec / H100_H200_PEAK, mem))
                print("# " + row_line(rows[-1]), flush=True)  # as it lands: a later failure keeps it
                bt0, anchors0, blocks0, labels0, _f0 = plans[0]
                parts = breakdown(drafter, head, opt, bt0, anchors0, blocks0, labels0, attn, loss_impl, cfg,
                                  args.acc_rows)
                parts_rows.append((impl, n_anchors, 1000 * statistics.median(per_batch[0]) if per_batch[0] else 0.0,
                                   parts))
                if args.profile == "on" and dev.type == "cuda":  # after every timing: no profiler before one
                    profiles.append((lambda p0=plans[0], step=step: step(*p0[:4], None),
                                     f"the drafter step on batch 0 ({impl}, {n_anchors} anchors)"))
            except Exception as exc:
                print(f"# {impl} at {n_anchors} anchors failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                failed.append(impl)
                opt.zero_grad(set_to_none=True)
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
        if args.precision == "on":
            print("# " + precision_check(drafter, head, plans[0], n_anchors), flush=True)
            losses_run = sorted({impl.split(":")[1] for impl in impls.split(",")} - {"bogus"})
            for line in loss_check(drafter, head, plans[0], losses_run, args.acc_rows):
                print(f"# loss check, anchors {n_anchors}: {line}", flush=True)
    for fn, what in profiles:
        kernel_profile(fn, what)
    print(f"\nbatches: {args.batches} of <= {args.token_budget} padded tokens (rows x longest), "
          f"{args.steps} timed passes after {args.warmup} warm-up, median per batch, averaged")
    print(HEADER)
    for r in rows:
        print(row_line(r))
    print("\nper-step breakdown on batch 0 (each part timed alone, forward + backward; mask: the flex path's "
          "packing and block masks; data is not in the step (prefetched); loss: the CE with the accuracy "
          f"metrics on {args.acc_rows or 'all'} rows (--acc-rows), as the step; loss, all rows: the metrics over "
          "every row instead (not in the step); other = the step minus the parts: fc/norms/embedding, packing, "
          "launch gaps):")
    print("| attention:loss | anchors/seq | step ms | data ms | mask ms | attention ms | MLP ms | loss ms "
          "| loss ms, all rows | optimizer ms | other ms |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for impl, n_anchors, step_ms, p in parts_rows:
        other = step_ms - sum(p[k] for k in ("mask", "attention", "mlp", "loss", "optimizer"))
        print(f"| {impl} | {n_anchors} | {step_ms:.1f} | {p['data']:.1f} | {p['mask']:.1f} | {p['attention']:.1f} "
              f"| {p['mlp']:.1f} | {p['loss']:.1f} | {p['loss_all_rows']:.1f} | {p['optimizer']:.1f} | {other:.1f} |")
    sys.stdout.flush()
    if failed:
        print(f"# failed: {', '.join(failed)} (the lines above say why)", flush=True)
        sys.exit(1)


def timed(fn, dev: torch.device, reps: int = 3) -> float:
    """Median ms of fn() over reps (after one untimed call: compiles and caches)."""
    fn()
    out = []
    for _ in range(reps):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        out.append(1000 * (time.perf_counter() - t0))
    return statistics.median(out)


def breakdown(drafter, head, opt, bt, anchors, blocks, labels, attn: str, loss_impl: str, cfg,
              acc_rows: int = ACC_ROWS) -> dict[str, float]:
    """The step's parts on one batch, each alone: data (anchors, block inputs and the context's
    host-to-device copy, what a step waits for when the data is not prefetched), the layers'
    attention (projections, norms, rotary, the attention, o_proj) and MLP (norm, SwiGLU,
    residual), the anchor-block loss with the accuracy metrics on `acc_rows` rows (as the step),
    the optimizer; each forward + backward under bf16 autocast. Beside them, not in the step: the
    loss with the metrics over every row (`loss_all_rows`: what --acc-rows 0 costs)."""
    from train.dflash.model import _layer_post, _layer_pre

    dev = anchors.device
    lengths = bt["lengths"].to(dev)
    host = bt["hidden"].to("cpu").pin_memory() if dev.type == "cuda" else bt["hidden"].cpu()
    ids_cpu, mask_cpu = bt["input_ids"], bt["loss_mask"]

    def data() -> None:
        a = sample_anchors(bt["lengths"], int(anchors.shape[1]), K, torch.Generator().manual_seed(0), mask_cpu)
        block_inputs(ids_cpu, a, K, cfg.mask_token_id, mask_cpu, bt["lengths"])
        host.to(dev, non_blocking=True)

    parts = {"data": timed(data, dev)}

    def mask() -> None:  # the step's masks, once per window kind, as prepare builds them
        if attn == "flex":
            from train.dflash.model import PackedBlockAttention

            packed = PackedBlockAttention(anchors, lengths, bt["hidden"].shape[1], K)
            for w in {cfg.layer_window(i) for i in range(cfg.num_layers)}:
                packed.block_mask(dev, w)

    parts["mask"] = timed(mask, dev)
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        with torch.no_grad():
            x, ctx, rope_q, rope_ctx, attend = drafter.prepare(bt["hidden"], head.embed_tokens(blocks), anchors,
                                                               lengths, attn_impl=attn)
        # both require grad, as in the step (fc and the context's k/v projections are trained): the
        # compiled regions see the inputs they were compiled for, no recompile here
        x, ctx = x.detach().requires_grad_(True), ctx.detach().requires_grad_(True)

        def attention() -> None:
            for layer in drafter.layers:
                pre = layer.regions[0] if layer.regions else _layer_pre
                qkv, _coef = pre(layer, x, ctx, rope_q, rope_ctx)
                out = layer.self_attn.output(attend(*qkv, window=layer.self_attn.window))
                out.float().sum().backward()

        def mlp() -> None:
            zero = torch.zeros(x.shape[0], cfg.num_heads, x.shape[1], cfg.head_dim, device=dev, dtype=x.dtype)
            for layer in drafter.layers:
                # the post region with a zero attention output (its o_proj, also in attention, is counted twice)
                post = layer.regions[1] if layer.regions else _layer_post
                post(layer, x, zero, None).float().sum().backward()

        parts["attention"] = timed(attention, dev)
        parts["mlp"] = timed(mlp, dev)
        with torch.no_grad():
            hid = drafter(bt["hidden"], head.embed_tokens(blocks), anchors, lengths, attn_impl=attn)
        hid = hid.detach().requires_grad_(True)

        def loss(rows: int | None) -> None:
            value, _ = drafter_loss(head, hid, labels, None, 0.0, 7.0, loss_impl=loss_impl, metric_rows=rows)
            value.backward()

        parts["loss"] = timed(lambda: loss(acc_rows or None), dev)
        parts["loss_all_rows"] = timed(lambda: loss(None), dev)
    parts["optimizer"] = timed(opt.step, dev)
    opt.zero_grad(set_to_none=True)
    return parts


# loss_head.py's tolerances against the fp32 reference: the loss within 0.05 + 2%, the gradient to
# the drafter's states within 2% in relative norm
LOSS_ATOL, LOSS_RTOL, GRAD_RTOL = 0.05, 0.02, 0.02


def loss_check(drafter, head, plan, impls: list[str], acc_rows: int) -> list[str]:
    """Each loss implementation run here against the fp32 reference on batch 0's drafter states:
    the loss and its gradient to those states (the only gradient the frozen head passes on), as
    the step computes them (bf16 autocast); the reference is the logits path in fp32, no autocast.
    A line per implementation with its errors and a verdict."""
    bt, anchors, blocks, labels, _f = plan
    dev = anchors.device
    with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16):
        hid0 = drafter(bt["hidden"], head.embed_tokens(blocks), anchors, bt["lengths"].to(dev),
                       attn_impl="flex" if dev.type == "cuda" else "dense").float()

    def run(impl: str, amp: bool) -> tuple[float, torch.Tensor]:
        hid = hid0.detach().clone().requires_grad_(True)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
            loss, _ = drafter_loss(head, hid, labels, None, 0.0, 7.0, loss_impl=impl, metric_rows=acc_rows or None)
        loss.backward()
        return float(loss), hid.grad.float()

    out = []
    try:
        want, want_grad = run("logits", False)
    except Exception as exc:
        return [f"the fp32 reference failed: {type(exc).__name__}: {str(exc)[:200]}"]
    for impl in impls:
        try:
            got, grad = run(impl, True)
        except Exception as exc:
            out.append(f"{impl}: failed: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        loss_err = abs(got - want)
        grad_err = float((grad - want_grad).norm() / want_grad.norm().clamp(min=1e-30))
        ok = loss_err <= LOSS_ATOL + LOSS_RTOL * abs(want) and grad_err <= GRAD_RTOL
        out.append(f"{impl}: loss {got:.5f} against fp32 {want:.5f} (error {loss_err:.2e}), gradient to the drafter "
                   f"states {100 * grad_err:.2f}% off in relative norm: "
                   f"{'within' if ok else 'OUTSIDE'} loss {LOSS_ATOL} + {100 * LOSS_RTOL:.0f}%, gradient "
                   f"{100 * GRAD_RTOL:.0f}%")
    return out


def precision_check(drafter, head, plan, n_anchors: int) -> str:
    """Dense against flex on one batch, both in bf16 autocast and both in fp32: a mask difference
    shows in fp32 (the paths agree to ~1e-5 there when the masks are the same); bf16 rounding shows
    as each bf16 path's distance to the fp32 output being of the size of their distance to each
    other. The dense fp32 reference runs in no-grad chunks (one layer's scores at a time)."""
    bt, anchors, blocks, _labels, _f = plan
    dev = anchors.device
    lengths = bt["lengths"].to(dev)
    out = {}
    with torch.no_grad():
        emb = head.embed_tokens(blocks)
        for impl in ("dense", "flex"):
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                out[impl, "bf16"] = drafter(bt["hidden"], emb, anchors, lengths, attn_impl=impl).float()
            out[impl, "fp32"] = drafter(bt["hidden"].float(), emb.float(), anchors, lengths, attn_impl=impl).float()

    def diff(a, b) -> float:
        return float((out[a] - out[b]).abs().max())

    fp32 = diff(("dense", "fp32"), ("flex", "fp32"))
    between = diff(("dense", "bf16"), ("flex", "bf16"))
    d_err, f_err = diff(("dense", "bf16"), ("dense", "fp32")), diff(("flex", "bf16"), ("dense", "fp32"))
    scale = float(out["dense", "fp32"].abs().max())
    verdict = ("masks agree; the bf16 difference is rounding" if fp32 <= 1e-3 * scale and between <= 2 * max(d_err, f_err)
               else "the paths compute different things (mask or semantics)")
    return (f"anchors {n_anchors}: max |out| {scale:.3e}; dense vs flex in fp32 {fp32:.3e}, in bf16 {between:.3e}; "
            f"bf16 vs fp32: dense {d_err:.3e}, flex {f_err:.3e}: {verdict}")


HEADER = ("| attention:loss | anchors/seq | blocks/step | ms/step | real tok/s | TFLOP/step | attention share "
          "| MFU | peak GiB |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|")


def row_line(r) -> str:
    return (f"| {r[0]} | {r[1]} | {r[2]:,.0f} | {r[3]:.1f} | {r[4]:,.0f} | {r[5]:.2f} | {100 * r[6]:.1f}% "
            f"| {100 * r[7]:.1f}% | {r[8]:.1f} |")


# The Qwen3.6-27B text stack (its config.json: 64 layers, every 4th full attention, 48 GDN value
# heads, untied head), for the extraction bench's --target 27b; random bf16 weights on the device.
QWEN36_27B_TEXT = ModelShape(
    hidden_size=5120, num_layers=64, full_attention_interval=4, num_heads=24, num_kv_heads=4, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
    intermediate_size=17408, base_vocab=248320, tie_word_embeddings=False)


def target_27b(dev: torch.device):
    """The 27B target's decoder stack as load_target builds a random one (on the device, bf16)."""
    from train.extract.target import Target, _build_base, resolve_dtype
    from train.stage1.model import text_config

    cfg = text_config(QWEN36_27B_TEXT)
    torch.manual_seed(0)
    base = _build_base(cfg, dev, resolve_dtype("auto", None, dev), init=True)
    return Target(base.eval().requires_grad_(False), cfg, "random:qwen3.6-27b")


def extract_bench(args) -> None:
    from train.common import fastpath
    from train.extract.extract import (
        HiddenCapture,
        copy_stream,
        pack_batch,
        pad_batch,
        plan_batches,
        target_forward,
        target_forward_packed,
        to_host,
    )
    from train.extract.target import load_target

    dev = torch.device(args.device)
    watch = FirstStep(args.first_step_limit, args.late)
    t0 = time.perf_counter()
    shape = "tiny" if args.smoke else "qwen35-2b"
    if args.target == "27b" and not args.smoke:
        shape = "qwen3.6-27b"
        target = target_27b(dev)
    else:
        target = load_target(None, shape, dev)
    kernels = fastpath.select_kernels(dev)
    fastpath.install_kernels(target.base, kernels)
    for line in kernels.header().splitlines():  # which GDN/conv kernels this forward runs
        print(f"# kernels: {line}", flush=True)
    print(f"# kernels: gated-delta-rule backend {kernels.gdn_backend or '-'}", flush=True)
    if args.layout == "packed":  # as the extractor runs it (train.extract.extract.write_one)
        from train.common import varlen_attention

        varlen_attention.use_attention(target.base, "varlen")
        print(f"# layout packed: {varlen_attention.describe('varlen', dev)}", flush=True)
    if args.compile == "on":  # as the extractor on CUDA (--compile auto)
        from train.common.regional_compile import apply_regional_compile

        apply_regional_compile(target.base, dynamic=args.layout == "packed")
    print(f"# target {shape} built in {time.perf_counter() - t0:.1f}s, vocab {target.vocab_size}", flush=True)
    layers = [1, 2] if args.smoke else [1, 16, 31, 46, 61] if args.target == "27b" else LAYERS
    capture = HiddenCapture(target.base, layers)
    lengths = conversations(400, 1)
    plan = plan_batches(lengths, args.token_budget)[: args.batches]
    gen = np.random.default_rng(0)
    if args.smoke:
        lengths = np.minimum(lengths, 256)
    samples = [gen.integers(0, target.vocab_size, size=int(n)) for n in lengths]
    times, phases = [], []
    pending = None
    for i in range(args.warmup + args.steps):
        b = plan[i % len(plan)]
        t = time.perf_counter()
        if args.layout == "packed":
            ids, lens, packing = pack_batch([samples[j] for j in b])
        else:
            ids, lens = pad_batch([samples[j] for j in b])
        t_pack = time.perf_counter()
        if args.layout == "packed":
            hidden, final = target_forward_packed(target.base, capture, ids.to(dev), packing)
        else:
            hidden, final = target_forward(target.base, capture, ids.to(dev))
        # what a shard write needs from the GPU: as the extractor copies it (to_host: pinned memory,
        # a side stream); with --overlap on the copy of batch i is waited for only after batch i+1's
        # forward, and a batch's time ends when the compute stream is done, not its own copy
        host = [to_host(hidden.to(torch.bfloat16)), to_host(final.to(torch.bfloat16))]
        del hidden, final
        t_fwd = t_wait = time.perf_counter()
        if dev.type == "cuda":
            done = torch.cuda.Event()
            done.record(copy_stream(dev))
            torch.cuda.current_stream(dev).synchronize()  # the forward (and the casts) ended
            t_fwd = time.perf_counter()
            if args.overlap == "on":
                if pending is not None:
                    pending[0].synchronize()  # the previous batch's copy, which ran beside this forward
                pending = (done, host)
            else:
                done.synchronize()
            t_wait = time.perf_counter()
        dt = t_wait - t
        watch.done("extraction batch 0")
        print(f"# batch {i}: {len(b)} x {ids.shape[1]} in {dt:.3f}s (pack {1000 * (t_pack - t):.1f} ms, forward "
              f"{1000 * (t_fwd - t_pack):.1f} ms, copy wait {1000 * (t_wait - t_fwd):.1f} ms)", flush=True)
        if i >= args.warmup:
            # FLOPs: a padded row attends over its whole width, a packed sample over itself
            if args.layout == "padded":
                width = ids.shape[1]
                done_flops = len(lens) * width * extraction_flops_per_token(target.config, width)
                useful = sum(n * extraction_flops_per_token(target.config, width) for n in lens)
            else:
                done_flops = useful = sum(n * extraction_flops_per_token(target.config, n) for n in lens)
            times.append((dt, ids.numel(), sum(lens), done_flops, useful))
            phases.append((t_pack - t, t_fwd - t_pack, t_wait - t_fwd))
    if pending is not None:  # the last batch's copy: in the timed total
        t = time.perf_counter()
        pending[0].synchronize()
        last_wait = time.perf_counter() - t
        times[-1] = (times[-1][0] + last_wait, *times[-1][1:])
        phases[-1] = (*phases[-1][:2], phases[-1][2] + last_wait)
    sec = sum(t[0] for t in times)
    padded = sum(t[1] for t in times)
    real = sum(t[2] for t in times)
    flops = sum(t[3] for t in times)
    useful = sum(t[4] for t in times)
    n = len(times)
    print("\n| target | batches | padded tok/batch | s/batch | samples/s | real tok/s | MFU (all tokens) "
          "| MFU (useful) | s per 16k real tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    samples_s = sum(len(plan[(args.warmup + i) % len(plan)]) for i in range(n)) / sec
    print(f"| {shape} (random, bf16, {args.layout}) | {n} | {padded / n:,.0f} | {sec / n:.3f} | {samples_s:.1f} | "
          f"{real / sec:,.0f} | {100 * flops / sec / H100_H200_PEAK:.1f}% | "
          f"{100 * useful / sec / H100_H200_PEAK:.1f}% | {16384 / (real / sec):.3f} |")
    print(f"# k* projection: target s per 16,384 real tokens {16384 / (real / sec):.3f}; "
          "k* = ceil(that / drafter s per 16k-token batch)", flush=True)
    if args.target != "27b":  # the 27B target's rate at this run's FLOP rate: an estimate, said so
        from train.stage1.model import text_config

        big = text_config(QWEN36_27B_TEXT)
        timed = [plan[(args.warmup + i) % len(plan)] for i in range(n)]
        flops_27b = sum(int(lengths[j]) * extraction_flops_per_token(big, int(lengths[j])) for b in timed for j in b)
        sec_27b = flops_27b / (flops / sec)
        print(f"# 27B target (Qwen3.6-27B text shape), scaled by FLOPs, NOT measured: {sum(map(len, timed)) / sec_27b:.1f} "
              f"samples/s on one GPU at this run's {100 * flops / sec / H100_H200_PEAK:.1f}% MFU ({flops_27b / real:.3g} "
              "FLOP per token; measure it with --target 27b)", flush=True)
    med = [1000 * statistics.median(x[j] for x in phases) for j in range(3)]
    print(f"# phases, median of the timed batches: pack (host) {med[0]:.1f} ms, forward (compute stream) "
          f"{med[1]:.1f} ms, waiting for the previous batch's device-to-host copy {med[2]:.1f} ms", flush=True)
    if args.profile == "on" and dev.type == "cuda":
        b = plan[0]

        def one_batch() -> None:
            if args.layout == "packed":
                ids, _lens, packing = pack_batch([samples[j] for j in b])
                hidden, final = target_forward_packed(target.base, capture, ids.to(dev), packing)
            else:
                hidden, final = target_forward(target.base, capture, pad_batch([samples[j] for j in b])[0].to(dev))
            to_host(hidden.to(torch.bfloat16)), to_host(final.to(torch.bfloat16))
            torch.cuda.synchronize(dev)

        kernel_profile(one_batch, f"extraction batch 0 ({len(b)} samples)")


def kernel_profile(fn, what: str, top: int = 12) -> None:
    """fn() once under torch.profiler: the GPU time by kernel family, and the top kernels, as
    table lines (what is left to win; the families are the trainers' own, train.common.profiler).
    Never fails the bench: a profiler error is one line."""
    try:
        from torch.profiler import profile

        from train.common.profiler import kernel_table, profile_activities

        dev = torch.device("cuda")
        with profile(activities=profile_activities(dev)) as prof:
            fn()
        print("\n" + "\n".join(kernel_table(prof, what, dev, top)), flush=True)
    except Exception as exc:  # the profile is a diagnosis, not the measurement
        print(f"# profile of {what} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("drafter", "extract"))
    p.add_argument("--anchors", default="4,512")
    p.add_argument("--impls", default="auto",
                   help="attention:loss pairs, comma-separated (dense|flex : logits|cce|liger|onepass); auto: the "
                        "trainer's defaults on this device")
    p.add_argument("--precision", choices=("on", "off"), default="on",
                   help="drafter: dense against flex on batch 0 in fp32 and bf16 (the mask check)")
    p.add_argument("--first-step-limit", type=float, default=0.0,
                   help="seconds from the process start to the first step's end; past it a LATE line and the "
                        "stacks (0: no limit)")
    p.add_argument("--late", choices=("warn", "fail"), default="warn", help="past --first-step-limit: go on or exit 3")
    p.add_argument("--token-budget", type=int, default=None)
    p.add_argument("--batches", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed passes first (drafter: 1 over every batch; extract: 2 batches, so both in-flight "
                        "batches' pinned host buffers exist before the timing, as in a long extraction)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script on a CPU")
    p.add_argument("--compile", choices=("on", "off"), default="on", help="the trainer's regional compile (auto: on)")
    p.add_argument("--dynamic", choices=("on", "off"), default="on",
                   help="drafter: compile with dynamic sizes from the first step (the trainer's); off: torch's "
                        "default (static first, one dynamic recompile at the second shape)")
    p.add_argument("--acc-rows", type=int, default=ACC_ROWS,
                   help="drafter: rows of the step the accuracy metrics are measured on, the trainer's --acc-rows "
                        "(0: every row, the extra lm_head pass over all of them)")
    p.add_argument("--target", choices=("2b", "27b"), default="2b",
                   help="drafter: the target shape the drafter is built for (27b: the qwen3.6-27b drafter); extract: "
                        "the target run (27b: the Qwen3.6-27B text stack, random bf16 weights, ~54 GB)")
    p.add_argument("--layout", choices=("packed", "padded"), default="packed",
                   help="extract: one varlen stream of the batch's real tokens (the extractor's), or padded rows")
    p.add_argument("--profile", choices=("on", "off"), default="on",
                   help="CUDA: one untimed extraction batch / drafter step under torch.profiler after the timed ones: "
                        "GPU time by kernel family and the top kernels")
    p.add_argument("--overlap", choices=("on", "off"), default="on",
                   help="extract: the device-to-host copy of a batch overlapped with the next forward")
    args = p.parse_args()
    if args.warmup is None:
        args.warmup = 1 if args.what == "drafter" else 2
    if args.token_budget is None:
        args.token_budget = 16384 if args.what == "drafter" else 65536
    (drafter_bench if args.what == "drafter" else extract_bench)(args)


if __name__ == "__main__":
    main()
