"""Stage-1 AR pretraining: setup (data, kernels, model, Stepper, resume) -> steps -> finish.

`python -m train.stage1 --shape tiny` always runs the Slurm guard first; `main(argv,
guard=False)` exists only so tests can drive the loop's internals outside Slurm.

Files written under --out (default $LAUNCH_JOB_DIR, else ./runs/stage1-local):
    metrics.jsonl       one record per step (appended; a resumed run appends more)
    checkpoints/        step_XXXXXXXX/ (MANIFEST.json-verified) and `latest`
    summary.json        steps, first/last loss, tok_s_all_ranks, paths; written atomically at the end
    outcome.json        completed / failed (the one-line error) / cancelled, and the step reached
    data/               the synthetic dataset, generated there when --data-dir is not given
    model_files/        config.json, the extended tokenizer, the image processor (train.stage1.export)
    export/step_X/      a transformers checkpoint of the last step (from_pretrained loads it)
Re-running the same argv with the same --out resumes from the newest checkpoint that verifies at
the same step with the same next batch (this is what submitit's requeue does); --restart starts
over and keeps the old checkpoints aside.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from toolkit import kernel_cache
from toolkit.fsutil import sha256_file
from toolkit.metrics import SCHEMAS, step_records
from train.common import fastpath, gdn_guard, mfu, regional_compile
from train.common.checkpoint import CheckpointError, load_state, rng_state, set_rng_state
from train.common.config import ConfigError
from train.common.distributed import DistInfo, slurm_layout
from train.common.entrypoint import run_entrypoint
from train.common.fastpath import FastPathError
from train.common.hf_local import HFLocalError
from train.common.levers import Levers, apply_levers
from train.common.losses import LossImplError
from train.common.metrics import compile_counts, peak_memory_mb
from train.common.packing import IGNORE_INDEX, model_kwargs, resolve_layout
from train.common.profiler import (
    ModuleTimer,
    ProgressWatch,
    StepProfiler,
    StepTiming,
    kernel_table,
    profile_activities,
    rank_spread,
)
from train.common.runtime import Runtime, pick_device
from train.common.shapes import get_shape
from train.common.stepper import Stepper, make_adamw, zero2_config
from train.common.vision_budget import VisionBudget, check_fits, derive_budget, fixed_budget
from train.stage1 import model as stage1_model  # stage1_model.build_model: tests wrap it

# The flags, their parse and checks live in train.stage1.args (no torch: `launch submit` vets the
# arguments with it before anything is queued); the names stay importable from here.
from train.stage1.args import (  # noqa: F401
    Stage1Config,
    check_tasks,
    codebook_config,
    parse_args,
    validate,
    vision_on,
)
from train.stage1.data import (
    IMAGE_TASKS,
    TASKS,
    DataConfig,
    DataError,
    Stage1Data,
    check_data_dir,
)
from train.stage1.export import ExportError, export_checkpoint, write_model_files
from train.stage1.objective import CausalLMObjective, ModelInputError
from train.stage1.synthetic import generate_synthetic
from train.stage1.tokenizer import TokenizerError, build_tokenizer

ENTRYPOINT = "train.stage1"
KERNEL_ARCHIVE_VAR = "LAUNCH_KERNEL_ARCHIVE"  # set by launch's job start: what it found for this node's key

# ---------------------------------------------------------------------------------------------


def lr_lambda(cfg: Stage1Config, horizon: int | None = None):
    """lr / --lr at (0-based) step: linear warmup over --warmup steps, then a cosine to
    --min-lr-ratio at step ``horizon`` (default --steps), and the final lr after it. A resumed run
    keeps its first --steps as the horizon (schedule_horizon): `launch resume --steps N` past it
    trains the new steps at the final lr, never re-stretching the cosine (a jump back up)."""
    horizon = cfg.steps if horizon is None else horizon

    def f(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        t = min(1.0, (step - cfg.warmup) / max(1, horizon - cfg.warmup))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))

    return f


def schedule_horizon(trainer_state: dict[str, Any] | None, cfg: Stage1Config) -> int:
    """The step the cosine ends at: the run's first --steps, kept across resumes (its checkpoints
    record it; one from before that record has its own run's --steps)."""
    if not trainer_state:
        return cfg.steps
    return int(trainer_state.get("schedule_horizon") or (trainer_state.get("config") or {}).get("steps") or cfg.steps)


def use_deepspeed(cfg: Stage1Config, device: torch.device, world_size: int) -> bool:
    # ZeRO-2 shards optimizer state and gradients across ranks; with one rank it only adds
    # overhead over a fused AdamW, so `auto` takes it on several CUDA ranks.
    return cfg.deepspeed == "on" or (cfg.deepspeed == "auto" and device.type == "cuda" and world_size > 1)


def make_optimizer(model: torch.nn.Module, cfg: Stage1Config, device: torch.device,
                   fused: bool | None = None, master_weights: bool | None = None) -> torch.optim.Optimizer:
    """The trainer's AdamW (train.common.stepper.make_adamw with this config's lr and decay)."""
    return make_adamw(model, cfg.lr, cfg.weight_decay, device, fused=fused, master_weights=master_weights)


def deepspeed_config(cfg: Stage1Config, device: torch.device) -> dict[str, Any]:
    if isinstance(cfg.deepspeed_config, dict):
        return cfg.deepspeed_config
    if cfg.deepspeed_config:
        try:
            config = json.loads(Path(cfg.deepspeed_config).read_text())
            if not isinstance(config, dict):
                raise ValueError("not a JSON object")
            return config
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--deepspeed-config {cfg.deepspeed_config}: not a readable DeepSpeed config "
                              f"({getattr(exc, 'strerror', None) or exc})") from None
    return zero2_config(cfg.batch_rows, cfg.grad_clip, device)


def make_stepper(objective: torch.nn.Module, model: torch.nn.Module, cfg: Stage1Config, device: torch.device,
                 dist_info: DistInfo, ds: bool, fused: bool | None = None, horizon: int | None = None) -> Stepper:
    return Stepper.create(objective, model, lr=cfg.lr, weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip,
                          lr_lambda=lr_lambda(cfg, horizon), device=device, dist=dist_info, deepspeed=ds,
                          deepspeed_config=deepspeed_config(cfg, device) if ds else None, fused=fused)


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




@dataclass
class StepResult:
    loss: float  # this rank's loss
    per_task: dict[str, torch.Tensor]  # per-task (sum, count) of this rank
    grad_norm: float | None
    skipped: bool  # the update was not applied (a non-finite step)


def train_step(stepper: Stepper, batch: dict[str, Any], device: torch.device,
               after_forward: Callable[[], None] | None = None) -> StepResult:
    """One optimizer step on one batch: forward (model + loss), backward, clip, update.

    `after_forward` runs between the loss and the backward (the profiler's forward mark).
    bench/stage1_gpu.py times exactly this function.
    """
    kwargs = {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v)
              for k, v in model_kwargs(batch).items()}
    target = {k: batch[k].to(device, non_blocking=True) for k in ("labels", "task_ids")}
    per_token = stepper.forward(**kwargs)
    loss, per_task = losses(per_token, target)
    if after_forward is not None:
        after_forward()
    stepper.backward(loss)
    grad_norm, skipped = stepper.step(loss)
    return StepResult(float(loss.detach()), per_task, grad_norm, skipped)


def main(argv: list[str] | None = None, guard: bool = True) -> int:
    """Entry point; returns the exit code. guard=False only for tests of the loop internals."""
    return run_entrypoint(ENTRYPOINT, argv, parse=parse_args, run=train, guard=guard,
                          run_errors=(DataError, FastPathError, LossImplError, TokenizerError, HFLocalError,
                                      ExportError, ModelInputError))


@dataclass
class Stage1Run:
    cfg: Stage1Config
    model: torch.nn.Module
    stepper: Stepper
    data: Stage1Data
    prof: StepProfiler
    progress: ProgressWatch
    flops_per_token: float
    peak_flops: float | None  # one device's; None where the peak is unknown (CPU): no MFU
    vision_config: Any = None  # the tower's config (its FLOPs count in MFU); None: text-only
    first_loss: float | None = None
    last_loss: float | None = None
    source: dict[str, Any] = field(default_factory=dict)  # data_source(): what the batches are drawn from
    horizon: int = 0  # the step the lr cosine ends at (schedule_horizon): the run's first --steps
    kernel_entries: dict[str, int] | None = None  # kernel cache files at process start (compile check)
    tower_timer: ModuleTimer | None = None  # the vision tower's forward time per step
    tower_ms: float = 0.0  # ... of the last step


def train(cfg: Stage1Config) -> int:
    """setup -> step -> finish on the shared runtime (train/common/runtime.py)."""
    ds = use_deepspeed(cfg, pick_device(), world_size=slurm_layout()[1])
    with Runtime.start(ENTRYPOINT, SCHEMAS["stage1"], cfg.out, tasks=TASKS, force_group=ds,
                       max_bad_steps=cfg.max_bad_steps, tensorboard=cfg.tensorboard,
                       wandb_project=cfg.wandb_project) as rt:
        regional_compile.configure_cache_dir()  # the caches where this run's compilers will look
        fastpath.configure_tilelang_cache()
        # a baked archive's torch artifacts, written into the caches before anything compiles; the
        # cache files counted after them, so what they put there is not taken for a compile
        artifacts = kernel_cache.load_torch_artifacts(kernel_cache.cache_dirs())
        entries = kernel_cache.count_entries(kernel_cache.cache_dirs())
        run = setup(cfg, rt, ds)
        run.kernel_entries = entries
        rt.print("# torch cache artifacts: " + (", ".join(f"{k} {v}" for k, v in artifacts.items()) + " loaded"
                                              if artifacts else "none in the inductor cache"))
        first_step = rt.step + 1
        while rt.step < cfg.steps:
            run.prof.start_step()
            batch = next(run.data)
            run.prof.data_ready()
            profiled = rt.step + 1 == cfg.profile_step
            with (torch.profiler.profile(activities=profile_activities(rt.device)) if profiled
                  else contextlib.nullcontext()) as kernels_seen:
                result = train_step(run.stepper, batch, rt.device, after_forward=run.prof.forward_done)
            # tokens/s and MFU count every token of the packed rows, padding included (torchtitan);
            # real_tok_s and mfu_useful leave the padding out.
            timing = run.prof.end_step(batch["input_ids"].numel() * rt.dist.world_size)
            run.tower_ms = run.tower_timer.take() if run.tower_timer is not None else 0.0
            rt.step += 1
            progress = run.progress.observe(rt.step, timing, step_load(batch))
            rt.check_finite(result.loss if rt.dist.world_size == 1 else None, result.grad_norm, result.skipped)
            run.first_loss = result.loss if run.first_loss is None else run.first_loss
            run.last_loss = result.loss
            compiled = check_kernel_compiles(run, rt) if rt.step == first_step else {}
            if profiled:
                for line in kernel_table(kernels_seen, f"step {rt.step}", rt.device, top=25):
                    rt.print(line)
            if rt.step % cfg.log_every == 0 or rt.step == cfg.steps:
                rt.log.log_step({**step_record(run, rt, batch, result, timing), **progress, **compiled})
            if cfg.ckpt_every and (rt.step % cfg.ckpt_every == 0 or rt.step == cfg.steps):
                save_checkpoint(run, rt)
        if os.environ.get(kernel_cache.BAKE_VAR):  # a bake: torch's artifacts of this process go into the archive
            saved = kernel_cache.save_torch_artifacts(kernel_cache.cache_dirs())
            rt.print(f"# torch cache artifacts saved: {saved or 'none (nothing compiled)'}")
        finish(run, rt)
    return 0


def setup(cfg: Stage1Config, rt: Runtime, ds: bool) -> Stage1Run:
    """Data (synthetic on first use), kernels, model, stepper, resume, header."""
    torch.manual_seed(cfg.seed)
    cfg.vision = vision_on(cfg)  # resolved once: the checkpoints record it, resume compares it
    codebooks = codebook_config(cfg)
    data_dir = Path(cfg.data_dir) if cfg.data_dir else rt.out / "data"
    if not cfg.data_dir and rt.dist.is_main and not (data_dir / "gen_img.jsonl").exists():
        counts = generate_synthetic(data_dir, cfg.synthetic_samples, seed=cfg.seed, shape=cfg.shape,
                                    codebooks=codebooks)
        rt.print(f"# generated synthetic data in {data_dir}: {counts}")
    rt.barrier()
    check_data_dir(data_dir)  # before the model is built: a wrong --data-dir fails in a second
    # The checkpoint to resume from, and whether it is of this model, before the model is built:
    # another --shape is one line in a second, not after building (say) a 2B model.
    _, latest = rt.checkpoints(cfg.keep_checkpoints, restart=cfg.restart)
    saved_state = _trainer_state(latest, rt.dist) if latest is not None else None
    if latest is not None:
        check_model_args(latest, saved_state.get("config") or {}, cfg)
    horizon = schedule_horizon(saved_state, cfg)
    if cfg.deepspeed_config:  # read at setup (not at submit: the file may exist only where the job runs)
        deepspeed_config(cfg, rt.device)
    # Kernels before the model exists: on GPU this refuses to go on without the fast path.
    # Every kernel of the job (GDN, conv, loss, attention): a fallback from the GPU locks' fast
    # path is refused here, in one line, unless --allow-slow-path.
    kernels = fastpath.select_kernels(rt.device, allow_slow_path=cfg.allow_slow_path, conv=cfg.conv_impl,
                                      loss=cfg.loss_impl, attention=cfg.attention,
                                      uniform_loss=True)  # sum / count: every target token weighs alike
    dtype = torch.bfloat16 if rt.device.type == "cuda" else torch.float32
    # The tokenizer first: a checkpoint whose tokenizer does not fit fails before the model is built.
    tok = build_tokenizer(get_shape(cfg.shape), cfg.init_from, bool(cfg.vision), codebooks)
    model, spec = stage1_model.build_model(cfg.shape, device=rt.device, dtype=dtype, init_from=cfg.init_from,
                                           vision=bool(cfg.vision), codebooks=codebooks, vision_ids=tok.vision_ids)
    # A dead GDN head (A_log -inf, a non-finite dt_bias) trains silently wrong: refused, named.
    gdn_guard.check_gdn_heads(model, f"--init-from {cfg.init_from}" if cfg.init_from else "the random init")
    fastpath.install_kernels(model, kernels)
    vision_lines = checkpoint_vision_tower(model) if cfg.vision and cfg.vision_ckpt else []
    lever_lines = apply_levers(model, rt.device, Levers(cfg.compile, cfg.attention, cfg.act_ckpt, cfg.compile_vision))
    # Every GDN/conv kernel variant the run's document layouts can select, compiled now (into the
    # node-local kernel cache), not mid-run: the first timed step is then the last slow one.
    t_warm = time.perf_counter()
    warmed = fastpath.warm_kernels(model, kernels, stream_len=cfg.batch_rows * cfg.row_len, max_doc=cfg.row_len,
                                   dtype=dtype)
    if warmed:
        lever_lines.append(f"warm-up: GDN + conv kernels for {warmed} document layouts of a "
                           f"{cfg.batch_rows * cfg.row_len}-token stream, {time.perf_counter() - t_warm:.1f} s")
    packing = resolve_layout(cfg.packing, rt.device.type)
    loss_impl = kernels.loss_impl or "logits"
    stepper = make_stepper(CausalLMObjective(model, loss_impl), model, cfg, rt.device, rt.dist, ds, horizon=horizon)
    data_state: dict[str, Any] = {"next_batch": 0}
    source = data_source(cfg, data_dir, tok)
    if latest is not None:
        rt.step, data_state = load_checkpoint(latest, stepper, cfg, rt.dist, report=rt.print, source=source)
        gdn_guard.check_gdn_heads(model, f"checkpoint {latest}")
        rt.print(f"# resumed from {latest} at step {rt.step}, next batch {data_state['next_batch']}")
    if horizon != cfg.steps:
        rt.print(f"# lr: the run's schedule, its cosine ending at step {horizon} (its first --steps)"
                 + (f"; steps {horizon + 1}-{cfg.steps} at the final lr {cfg.lr * cfg.min_lr_ratio:.3g}"
                    if cfg.steps > horizon else ""))
    if rt.dist.is_main:  # after the resume: a run refused over others' checkpoints leaves their files alone
        write_model_files(rt.out, model, tok, model_info(cfg, spec, tok))
    budget = step_vision_budget(cfg, model, spec, rt, ds) if tok.encoder is not None else None
    if budget is not None and cfg.vision_budget == "auto":
        try:
            check_fits(budget, tok.encoder.max_tokens)
        except ValueError as exc:
            raise DataError(str(exc)) from None
    data = Stage1Data(
        DataConfig(str(data_dir), row_len=cfg.row_len, batch_rows=cfg.batch_rows, seed=cfg.seed,
                   weights=cfg.weights, max_bad_fraction=cfg.max_bad_fraction, num_workers=cfg.num_workers,
                   packing=packing, vision_budget=budget, max_segments=gdn_guard.max_segments(model)),
        tok, rank=rt.dist.rank, state=data_state, report=rt.print,
    )
    flops_per_token, peak, peak_source = mfu_terms(model, cfg, rt.device)
    rt.log.header({
        "shape": cfg.shape, "params": spec.n_params, "vocab": spec.vocab.padded_vocab,
        "vocab_used": spec.vocab.used_vocab, "tokenizer": tok.name, "device": rt.device.type,
        "world": rt.dist.world_size, "deepspeed": ds, "row_len": cfg.row_len, "batch_rows": cfg.batch_rows,
        "start_step": rt.step, "steps": cfg.steps, "flops_per_token": f"{flops_per_token:.4g}",
        "mfu_peak": f"{peak:.4g} ({peak_source})" if peak else f"n/a ({peak_source})", "loss_impl": loss_impl,
        "optimizer": stepper.name, "vision_params": spec.n_vision_params,
        **({"vision_flops_per_patch": 6 * mfu.vision_matmul_params(vision_config(model))}
           if vision_config(model) is not None else {}),
        "kernel_archive": os.environ.get(KERNEL_ARCHIVE_VAR) or "none looked for (not started by launch)",
        **({"vision_budget": budget.header() if budget else "off (unbounded)"} if tok.encoder is not None else {}),
    })
    rt.print(mixture_line(data, tok))
    rt.print("# " + kernels.header().replace("\n", "\n# "))
    for line in [f"packing: {packing}", *lever_lines, *vision_lines, STEP_LINE_LEGEND]:
        rt.print(f"# {line}")
    model.train()
    return Stage1Run(cfg, model, stepper, data, StepProfiler(rt.device), ProgressWatch(cfg.steps, rt.device),
                     flops_per_token, peak, vision_config=vision_config(model), source=source, horizon=horizon,
                     tower_timer=ModuleTimer(model.model.visual, rt.device) if cfg.vision else None)


STEP_LINE_LEGEND = ("step line: step n/N, loss (per task: gi gen_img, gt gen_txt, un und, ri replay_img, "
                    "rt replay_text), tok/s, useful-token MFU, compute+data ms, peak GiB, eta; STALL(cause) on a "
                    "step > 2x the running median (and >= 0.5 s over it): compile, allocator, data, images, or "
                    "unknown (none of those moved)")


def check_kernel_compiles(run: Stage1Run, rt: Runtime) -> dict[str, Any]:
    """After this process's first step: the kernels compiled since it started (new files in the
    Triton, TileLang, Inductor and CUTLASS DSL caches), said in one line. With a baked archive unpacked for
    this node (the job's start says so in $LAUNCH_KERNEL_ARCHIVE) every one of them should have
    been there: a compile is then a warning, or with --require-warm-kernels the run's error."""
    now = kernel_cache.count_entries(kernel_cache.cache_dirs())
    new = {k: max(0, now[k] - (run.kernel_entries or {}).get(k, 0)) for k in now}
    archive = os.environ.get(KERNEL_ARCHIVE_VAR, "")
    had_archive = archive.startswith(("unpacked ", "present "))
    age = process_age_s()
    hits = kernel_cache.torch_cache_hits()
    rt.print(f"# kernel compiles by the end of step {rt.step}: " + ", ".join(f"{k} {v}" for k, v in new.items())
             + f" (archive: {archive.split(':')[0] if archive else 'none looked for'})"
             + (f"; torch caches (hit/miss): fx graph {hits['fxgraph_hit']}/{hits['fxgraph_miss']}, "
                f"aot_autograd {hits['aot_autograd_hit']}/{hits['aot_autograd_miss']}" if hits else "")
             + (f"; step {rt.step} ended {age:.1f} s after the process started" if age is not None else ""))
    if had_archive and sum(new.values()):
        message = (f"the baked kernel archive ({archive.split(':')[0]}) was unpacked, yet "
                   f"{sum(new.values())} kernel cache files were compiled by the end of step {rt.step} "
                   f"({new}): the archive does not cover this run's kernels; bake it again for this preset")
        if run.cfg.require_warm_kernels:
            raise FastPathError(message)
        rt.print(f"# WARNING: {message}")
    return {"kernel_compiles": new, "since_start_s": age, **({"torch_cache": hits} if hits else {})}


def process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc; None elsewhere): imports, model build,
    kernel warm-up and the first step, the time a fresh node waits before training."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


def step_load(batch: dict[str, Any]) -> dict[str, float]:
    """What of a batch can make its step slow beyond its fixed token count: its images."""
    grid = batch.get("image_grid_thw")
    return {"images": 0 if grid is None else len(grid), "vision_tokens": batch.get("vision_tokens", 0)}


def step_vision_budget(cfg: Stage1Config, model: torch.nn.Module, spec: Any, rt: Runtime,
                       ds: bool) -> VisionBudget | None:
    """--vision-budget: the images and vision tokens one rank's step may hold (None: off).

    auto: train.common.vision_budget's formula for this model, step and device (a GPU's memory; on
    the CPU the host's, which bounds the demo too)."""
    if cfg.vision_budget == "off":
        return None
    if cfg.vision_budget != "auto":
        return fixed_budget(int(cfg.vision_budget))
    if rt.device.type == "cuda":
        memory, name = torch.cuda.get_device_properties(rt.device).total_memory, torch.cuda.get_device_name(rt.device)
    else:
        memory, name = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host memory (cpu)"
    text = stage1_model.text_model_config(model)
    return derive_budget(vision=vision_config(model), params=spec.n_params, layers=text.num_hidden_layers,
                         hidden=text.hidden_size, step_tokens=cfg.batch_rows * cfg.row_len, device_memory=memory,
                         zero_shards=rt.dist.world_size if ds else 1, device_name=name)


def mixture_line(data: Stage1Data, tok: Any) -> str:
    """`# mixture: task weight[ images ...], ...`: the effective mixture (normalized weights) and
    where each image task's images go: through the vision tower, or 16 colour stand-in tokens."""
    sampler = data.dataset.sampler
    images = "tower" if tok.encoder is not None else "colour tokens"
    parts = [f"{t} {w:.3f}" + (f" (images: {images})" if t in IMAGE_TASKS else "")
             for t, w in zip(sampler.tasks, sampler.probs.tolist(), strict=True)]
    return "# mixture: " + ", ".join(parts)


def step_record(run: Stage1Run, rt: Runtime, batch: dict[str, Any], result: StepResult,
                timing: StepTiming) -> dict[str, Any]:
    """The metrics of one logged step. Collective on several ranks: every rank calls it."""
    loss, task_loss = reduce_task_losses(result.per_task, rt.dist)
    compiles, recompiles = compile_counts()
    tok_s, useful = timing.tokens_per_s, batch["packing_efficiency"]
    vision = step_vision_flops(run, rt, batch)
    mfu_all = mfu_useful = None
    if run.peak_flops and timing.step_ms > 0:  # the tower's FLOPs count in both: images are never padding
        vision_per_s = vision / (timing.step_ms / 1000)
        peak = run.peak_flops * rt.dist.world_size
        mfu_all = (tok_s * run.flops_per_token + vision_per_s) / peak
        mfu_useful = (tok_s * useful * run.flops_per_token + vision_per_s) / peak
    return {
        "step": rt.step, "loss": loss, "task_loss": task_loss, "tok_s": tok_s, "real_tok_s": tok_s * useful,
        "mfu": mfu_all, "mfu_useful": mfu_useful, "vision_flops": vision,
        "images": 0 if batch.get("image_grid_thw") is None else len(batch["image_grid_thw"]),
        "vision_tokens": batch.get("vision_tokens", 0), "budget_waits": batch.get("budget_waits", 0),
        "data_ms": timing.data_ms, "compute_ms": timing.compute_ms, "peak_mem_mb": peak_memory_mb(rt.device),
        "compiles": compiles, "recompiles": recompiles, "lr": run.stepper.step_lr, "grad_norm": result.grad_norm,
        "packing_efficiency": useful, "batch_index": batch["batch_index"], "batch_digest": batch_digest(batch),
        "fwd_ms": timing.forward_ms, **forward_mfus(run, rt, batch, timing), **(rank_spread(timing, rt.device) if rt.dist.world_size > 1 else {}),
    }


def forward_mfus(run: Stage1Run, rt: Runtime, batch: dict[str, Any], timing: StepTiming) -> dict[str, Any]:
    """The tower's own forward time and forward MFU beside the trunk's (this rank's).

    vision_mfu = the tower's forward FLOPs (a third of mfu.vision_flops) / its forward time / peak;
    trunk_fwd_mfu = the text model's forward FLOPs (a third of flops_per_token per token) over the
    rest of the forward (the forward mark includes the loss) / peak. Forward only: the backward
    of the two is not timed apart."""
    if run.tower_timer is None:
        return {}
    tower_ms = run.tower_ms
    out: dict[str, Any] = {"vision_fwd_ms": tower_ms, "vision_mfu": None, "trunk_fwd_mfu": None}
    if run.peak_flops:
        flops = mfu.vision_flops(run.vision_config, batch.get("image_grid_thw")) / 3
        if tower_ms > 0 and flops > 0:
            out["vision_mfu"] = flops / (tower_ms / 1e3) / run.peak_flops
        trunk_ms = (timing.forward_ms or 0.0) - tower_ms
        if trunk_ms > 0:
            out["trunk_fwd_mfu"] = batch["input_ids"].numel() * run.flops_per_token / 3 / (trunk_ms / 1e3) / run.peak_flops
    return out


def step_vision_flops(run: Stage1Run, rt: Runtime, batch: dict[str, Any]) -> float:
    """The vision tower's FLOPs of this step over all ranks (train.common.mfu.vision_flops of each
    rank's images). Collective on several ranks, like step_record."""
    if run.vision_config is None:
        return 0.0
    flops = mfu.vision_flops(run.vision_config, batch.get("image_grid_thw"))
    if rt.dist.world_size > 1:
        total = torch.tensor([flops], dtype=torch.float64, device=rt.device)
        torch.distributed.all_reduce(total)
        flops = float(total)
    return flops


def finish(run: Stage1Run, rt: Runtime) -> None:
    run.data.close()
    if not rt.is_logger:
        return
    metrics = rt.out / "metrics.jsonl"
    summary = {
        "steps": rt.step, "first_loss": run.first_loss, "last_loss": run.last_loss,
        # the one throughput figure: every token of the packed rows (padding included), all ranks
        # together, over this process's steps
        "tok_s_all_ranks": run.prof.mean_tokens_per_s if run.prof.total_s else None,
        "out_dir": str(rt.out.resolve()), "metrics": str(metrics.resolve()),
        "checkpoint": str((rt.out / "checkpoints").resolve()), "shape": run.cfg.shape,
    }
    if run.cfg.export and run.cfg.ckpt_every:
        summary["export"] = str(export_checkpoint(rt.out, None, None).resolve())
    summary.update(_loss_span(metrics))
    rt.finish(summary)


def batch_digest(batch: dict[str, Any]) -> str:
    """Short hash of a batch's tokens: lets a resumed run prove it sees the same next batch."""
    return hashlib.sha1(batch["input_ids"].numpy().tobytes()).hexdigest()[:16]


def _loss_span(metrics_path: Path) -> dict[str, Any]:
    """first/last loss over the whole run, including steps before a resume."""
    recs = step_records(metrics_path) if metrics_path.exists() else []
    return {"first_loss": recs[0]["loss"], "last_loss": recs[-1]["loss"]} if recs else {}


def checkpoint_vision_tower(model: torch.nn.Module) -> list[str]:
    """--vision-ckpt: transformers' activation checkpointing (non-reentrant) on every block of the
    vision tower, the text layers left as --act-ckpt has them. Returns the header line."""
    tower = model.model.visual
    from transformers.utils import logging as hf_logging

    kwargs = {"use_reentrant": False}
    level = hf_logging.get_verbosity()
    # transformers warns that the tower "does not expose input embeddings": that matters for the
    # reentrant variant only (its inputs would need grad); the non-reentrant one needs none.
    hf_logging.set_verbosity_error()
    try:
        if hasattr(tower, "activation_checkpointing_enable"):  # transformers >= 5.2x; the older name is deprecated
            tower.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            tower.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    finally:
        hf_logging.set_verbosity(level)
    return [f"vision tower: activation checkpointing of its {len(tower.blocks)} blocks"]


def vision_config(model: torch.nn.Module) -> Any:
    """The model's vision tower config, None for the text-only model."""
    return getattr(getattr(model, "config", None), "vision_config", None)


def mfu_terms(model: torch.nn.Module, cfg: Stage1Config, device: torch.device) -> tuple[float, float | None, str]:
    """(model FLOPs per token, peak FLOP/s of one device or None, the device named).

    The peak is known only for the GPUs train.common.mfu lists; elsewhere (a CPU, an unlisted GPU)
    there is no MFU, rather than a number against a peak the device does not have. The text
    model's FLOPs per token; the vision tower's depend on the step's images, so step_record adds
    them per step (train.common.mfu.vision_flops).
    """
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = mfu.peak_flops(name)
    return mfu.flops_per_token(stage1_model.text_model_config(model), cfg.row_len), peak, name if peak else f"{name}: peak unknown"


def model_info(cfg: Stage1Config, spec: Any, tok: Any) -> dict[str, Any]:
    """What the export's README says was trained (model_files/stage1.json)."""
    c = spec.vocab.config
    return {"shape": cfg.shape, "vision": bool(cfg.vision), "init_from": cfg.init_from, "tokenizer": tok.name,
            "has_tokenizer": hasattr(tok, "hf"), "base_vocab": spec.vocab.base_vocab,
            "codebook_sizes": [c.ss, c.shape, c.tex], "asset_lengths": ["any" if n is None else n for n in c.lengths],
            "n_specials": len(c.specials), "vocab": spec.vocab.padded_vocab}


# ---------------------------------------------------------------------------------------------
# checkpoints


def save_checkpoint(run: Stage1Run, rt: Runtime) -> None:
    def write(tmp: Path) -> None:
        trainer = {"step": rt.step, "data": run.data.state_dict(), "rng": rng_state(), "config": asdict(run.cfg),
                   "source": run.source, "schedule_horizon": run.horizon}
        torch.save(trainer, tmp / f"trainer_rank{rt.dist.rank:05d}.pt")
        run.stepper.save(tmp, rt.dist.is_main)

    rt.save(write)


# What the model is made of (a change cannot resume) and what the batches are made of (a change
# resumes, but batch k is then not the batch k of the original run: said in one line).
MODEL_ARGS = ("shape", "vision", "codebook_sizes")
DATA_ARGS = ("row_len", "batch_rows", "seed", "packing")
# What the batches are drawn from: a change resumes only with --allow-data-change (a model trained
# on one dataset and continued on another without a word is a silent mistake).
SOURCE_FLAGS = {"data_dir": "--data-dir", "manifests": "the manifests (sha256) of --data-dir",
                "weights": "--weights", "asset_lengths": "--asset-lengths", "tokenizer": "the tokenizer"}


def data_source(cfg: Stage1Config, data_dir: Path, tok: Any) -> dict[str, Any]:
    return {"data_dir": str(data_dir.resolve()), "manifests": manifests_digest(data_dir), "weights": cfg.weights,
            "asset_lengths": cfg.asset_lengths, "tokenizer": tok.fingerprint}


def manifests_digest(data_dir: Path) -> str:
    """The data's identity by content: a sha256 over each task's manifest (its name and bytes). A run
    folder moved or copied with its data resumes on this, not on the path; an edited manifest is a
    change of data. Only regular files are read (load_manifests refuses the others, named)."""
    h = hashlib.sha256()
    for task in TASKS:
        path = data_dir / f"{task}.jsonl"
        if path.is_file():
            h.update(f"{task}\0{sha256_file(path)}\0".encode())
    return h.hexdigest()


def _shown(value: Any) -> str:
    """A flag's value as the command line spells it."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    return json.dumps(value) if isinstance(value, dict) else str(value)


def _check_source(path: Path, saved: dict[str, Any], source: dict[str, Any], allow: bool, next_batch: int,
                  report: Callable[[str], None]) -> None:
    same_manifests = "manifests" in saved and saved["manifests"] == source.get("manifests")
    for key, flag in SOURCE_FLAGS.items():
        if key not in saved or key not in source or saved[key] == source[key]:
            continue
        was, now = _shown(saved[key]), _shown(source[key])
        if key == "data_dir" and same_manifests:  # the run folder moved or copied with its data
            report(f"# --data-dir {now}: the same manifests (sha256) as checkpoint {path}'s {was}; resuming on it")
            continue
        if key == "data_dir" and "manifests" in saved:
            now += " (its manifests differ)"
        if key == "manifests" and saved.get("data_dir") != source.get("data_dir"):
            continue  # said with --data-dir
        if key == "manifests":
            was, now = was[:16], f"{now[:16]} (edited in place)"
        if not allow:
            raise CheckpointError(f"checkpoint {path} was trained with {flag} {was}, this run has {now}: resume with the "
                                  "same data, add --allow-data-change to continue on this data, or use a new --out "
                                  "or --restart")
        report(f"# --allow-data-change: resuming with {flag} {now} where checkpoint {path} has {was}: batches from "
               f"{next_batch} on are drawn from other data than the original run's")


def _trainer_state(path: Path, dist_info: DistInfo) -> dict[str, Any]:
    trainer_file = path / f"trainer_rank{dist_info.rank:05d}.pt"
    if not trainer_file.is_file():
        raise CheckpointError(f"{trainer_file} is missing: checkpoint {path} was written by a different world size")
    trainer = load_state(trainer_file)
    check_trainer_state(trainer_file, trainer, path.name)
    return trainer


def check_trainer_state(file: Path, trainer: Any, step_dir: str) -> None:
    """The trainer state is what save_checkpoint writes (a file anyone who can write the run folder can
    edit, its manifest rehashed): its fields of their types, its step the checkpoint directory's own
    (a step of 10^12 would "complete" the run without training). CheckpointError naming the file."""
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{file} is not this trainer's state ({why}); delete checkpoint {file.parent} to "
                               "resume from the one before, or use --restart")

    if not isinstance(trainer, dict):
        raise bad(f"it holds a {type(trainer).__name__}, not a dict")
    for key, kind in (("step", int), ("data", dict), ("rng", dict), ("config", dict), ("source", dict)):
        value = trainer.get(key)
        if (key in ("step", "data", "rng") or value is not None) and (type(value) is not kind if kind is int
                                                                       else not isinstance(value, kind)):
            raise bad(f"its {key} is {type(value).__name__ if value is not None else 'missing'}, not {kind.__name__}")
    next_batch = trainer["data"].get("next_batch")
    if type(next_batch) is not int or next_batch < 0:
        raise bad(f"its data.next_batch is {next_batch!r:.40}, not a batch number")
    if step_dir.startswith("step_") and step_dir[5:].isdigit() and trainer["step"] != int(step_dir[5:]):
        raise bad(f"its step is {trainer['step']}, the checkpoint is {step_dir}")


def check_model_args(path: Path, saved: dict[str, Any], cfg: Stage1Config) -> None:
    """One line naming both values when the checkpoint is of another model (other shape
    changes: Stepper.load names the first mismatching tensor and both sizes)."""
    for key in MODEL_ARGS:
        if key in saved and saved[key] != getattr(cfg, key):
            raise CheckpointError(f"checkpoint {path} was written with --{key.replace('_', '-')} {_shown(saved[key])}, "
                                  f"this run has {_shown(getattr(cfg, key))}: resume with the same model arguments, "
                                  "or use a new --out or --restart")


def load_checkpoint(path: Path, stepper: Stepper, cfg: Stage1Config, dist_info: DistInfo,
                    report: Callable[[str], None] = print,
                    source: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    trainer = _trainer_state(path, dist_info)
    saved = trainer.get("config") or {}
    check_model_args(path, saved, cfg)
    for key in DATA_ARGS:
        if key in saved and saved[key] != getattr(cfg, key):
            report(f"# resuming with --{key.replace('_', '-')} {_shown(getattr(cfg, key))} where checkpoint {path} has "
                   f"{_shown(saved[key])}: batches from {trainer['data']['next_batch']} on differ from the original "
                   "run's")
    # A checkpoint from before "source" was recorded: its config's flags stand in (no tokenizer).
    saved_source = trainer.get("source") or {k: saved[k] for k in ("weights", "asset_lengths") if k in saved}
    _check_source(path, saved_source, source or {}, cfg.allow_data_change, trainer["data"]["next_batch"], report)
    stepper.load(path)
    try:
        set_rng_state(trainer["rng"])
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as exc:  # another version's, or edited
        raise CheckpointError(f"{path / f'trainer_rank{dist_info.rank:05d}.pt'}: its RNG state does not load here "
                              f"({type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else exc!r}); delete "
                              f"checkpoint {path} to resume from the one before, or use --restart") from None
    return int(trainer["step"]), trainer["data"]
