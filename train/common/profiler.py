"""Step profiler: where did the step go, waiting for data or computing?

Usage, one step:
    prof.start_step()
    batch = next(it)               # data wait
    prof.data_ready()
    loss = train_step(batch)       # compute; it may call prof.forward_done() after the forward
    timing = prof.end_step(n_tokens)
CUDA work is asynchronous, so on a GPU the start and end of a step synchronise the device;
otherwise the compute time would leak into the next step's data wait. The forward mark is a CUDA
event instead (read at end_step), so it costs no extra synchronisation.

`rank_spread` gathers every rank's timing of one step. The forward pass of data parallelism
(DDP, ZeRO-2) has no collective in it, so per-rank forward times show a straggler that the
step time, equalised by the gradient all-reduce, hides.
"""

from __future__ import annotations

import collections
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class StepTiming:
    data_ms: float
    compute_ms: float
    tokens: int
    forward_ms: float | None = None  # data ready -> forward_done(), when the step marked it

    @property
    def step_ms(self) -> float:
        return self.data_ms + self.compute_ms

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / (self.step_ms / 1000.0) if self.step_ms > 0 else 0.0


class StepProfiler:
    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._t0 = self._t_data = 0.0
        self._t_fwd: float | None = None
        self._ev_data = self._ev_fwd = None
        self.total_tokens = 0
        self.total_s = 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start_step(self) -> None:
        self._sync()
        self._t0 = self._t_data = time.perf_counter()

    def data_ready(self) -> None:
        self._t_data = time.perf_counter()
        self._t_fwd, self._ev_fwd = None, None
        if self.device.type == "cuda":
            self._ev_data = torch.cuda.Event(enable_timing=True)
            self._ev_data.record()

    def forward_done(self) -> None:
        if self.device.type == "cuda":
            self._ev_fwd = torch.cuda.Event(enable_timing=True)
            self._ev_fwd.record()
        else:
            self._t_fwd = time.perf_counter()

    def end_step(self, tokens: int) -> StepTiming:
        self._sync()
        t_end = time.perf_counter()
        forward_ms = None
        if self._ev_fwd is not None and self._ev_data is not None:
            forward_ms = self._ev_data.elapsed_time(self._ev_fwd)
        elif self._t_fwd is not None:
            forward_ms = (self._t_fwd - self._t_data) * 1e3
        timing = StepTiming((self._t_data - self._t0) * 1e3, (t_end - self._t_data) * 1e3, tokens, forward_ms)
        self.total_tokens += tokens
        self.total_s += t_end - self._t0
        return timing

    @property
    def mean_tokens_per_s(self) -> float:
        return self.total_tokens / self.total_s if self.total_s > 0 else 0.0


def rank_spread(timing: StepTiming, device: torch.device) -> dict[str, Any]:
    """Every rank's data wait, forward and compute time of this step, and the forward spread.

    A collective: every rank must call it at the same step. `fwd_spread` is (slowest - fastest)
    forward over the median forward; near 0 means no straggler.
    """
    local = torch.tensor([timing.data_ms, timing.forward_ms or 0.0, timing.compute_ms],
                         dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    data_ms, fwd_ms, compute_ms = (list(col) for col in zip(*(t.tolist() for t in gathered), strict=True))
    median_fwd = statistics.median(fwd_ms)
    return {"rank_data_ms": data_ms, "rank_fwd_ms": fwd_ms, "rank_compute_ms": compute_ms,
            "fwd_spread": (max(fwd_ms) - min(fwd_ms)) / median_fwd if median_fwd > 0 else 0.0}


# --- progress (ETA) and stalls

STALL_FACTOR = 2.0  # a step longer than this times the running median is a stall
# ... and longer than the median by at least this much: tiny CPU steps (tens of ms) double on a
# busy host's scheduling noise alone, which no one can act on; a GPU step of ~1 s must exceed 2 s.
MIN_STALL_EXCESS_S = 0.5
_MEDIAN_WINDOW = 200  # steps the running median (and so the ETA) looks back over


def kernel_cache_dirs() -> dict[str, Path]:
    """The on-disk kernel caches a run's JIT compilers write a new entry into per compiled kernel:
    Triton's (fla's kernels, inductor's generated ones), TileLang's (fla's GDN backward on
    Hopper), inductor's own and the CUTLASS DSL's (liger-sm90). Loading a kernel from them adds nothing, so a changed directory
    means a compile happened."""
    home = Path.home()
    user = os.environ.get("USER") or "user"
    return {
        "triton": Path(os.environ.get("TRITON_CACHE_DIR") or home / ".triton" / "cache"),
        "tilelang": Path(os.environ.get("TILELANG_CACHE_DIR") or home / ".tilelang" / "cache"),
        "inductor": Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or Path(tempfile.gettempdir()) / f"torchinductor_{user}"),
        # the CUTLASS DSL's (liger-sm90's CuTe kernels), as it resolves its default
        "cute_dsl": Path(os.environ.get("CUTE_DSL_CACHE_DIR")
                         or Path(os.environ.get("TMPDIR") or tempfile.gettempdir()) / user / "cutlass_python_cache"),
    }


def stall_counters(device: torch.device, cache_dirs: dict[str, Path] | None = None) -> dict[str, float]:
    """What can explain a slow step, as counters that only grow (or change): dynamo's compiled
    graphs + recompiles and seconds spent compiling, the kernel caches' directory mtimes, and on
    CUDA the caching allocator's cudaMalloc calls and alloc retries (a retry frees the cache and
    synchronises)."""
    out: dict[str, float] = {}
    if "torch._dynamo" in sys.modules:
        from torch._dynamo.utils import compilation_time_metrics, counters

        out["dynamo"] = float(counters["stats"].get("unique_graphs", 0) + sum(counters["recompiles"].values()))
        out["compile_s"] = float(sum(sum(v) for v in compilation_time_metrics.values()))
    for name, path in (kernel_cache_dirs() if cache_dirs is None else cache_dirs).items():
        try:
            out[f"cache_{name}"] = float(path.stat().st_mtime_ns)
        except OSError:
            out[f"cache_{name}"] = 0.0
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        out["alloc_retries"] = float(stats.get("num_alloc_retries", 0))
        out["device_allocs"] = float(stats.get("num_device_alloc", 0))  # cudaMalloc: the reserve grew
        out["device_frees"] = float(stats.get("num_device_free", 0))  # cudaFree: the cache was emptied
        out["reserved_peak"] = float(stats.get("reserved_bytes.all.peak", 0))
    return out


ALLOCATOR_COUNTERS = ("alloc_retries", "device_allocs", "device_frees", "reserved_peak")


def stall_cause(before: dict[str, float], after: dict[str, float], timing: StepTiming,
                median_s: float | None = None, load: dict[str, float] | None = None,
                median_load: dict[str, float] | None = None) -> str:
    """The known causes of one slow step, `+`-joined; else `unknown`:

    compile    dynamo compiled (graphs, recompiles, compile seconds) or a kernel cache got an entry
    allocator  the caching allocator went to the driver: cudaMalloc/cudaFree, an alloc retry (which
               frees the cache and synchronises), or the reserved peak grew
    data       the step waited for its batch for more than half of its excess over the median (all
               of the step, when no median is given, over half of it)
    images     the step held more images or vision tokens (``load``) than the median step
    """
    changed = {k for k in after if after[k] != before.get(k, after[k])}
    causes = []
    if changed & {"dynamo", "compile_s"} or any(k.startswith("cache_") for k in changed):
        causes.append("compile")
    if changed & set(ALLOCATOR_COUNTERS):
        causes.append("allocator")
    excess_ms = timing.step_ms - 1000.0 * median_s if median_s is not None else timing.step_ms
    if timing.step_ms > 0 and timing.data_ms > 0.5 * excess_ms:
        causes.append("data")
    if load and median_load and any(load.get(k, 0) > median_load.get(k, 0) for k in load):
        causes.append("images")
    return "+".join(causes) or "unknown"


class ProgressWatch:
    """`steps_total`, `eta_s` and, on a stalled step, `stall` (its cause) for each step record.

    The ETA is the running median step time (over the last steps of this process, its first step
    left out: that one compiles) times the steps left. A step is stalled when it takes more than
    STALL_FACTOR times the median of the steps before it AND more than MIN_STALL_EXCESS_S over it.
    Steps are judged from the first that has a median (a process's 3rd step: its 1st compiles and
    is left out, its 2nd is the median's first). ``load`` (``observe``'s, e.g. images and vision
    tokens) has running medians of its own: a stalled step above them has cause `images`.
    """

    def __init__(self, steps_total: int, device: torch.device | str = "cpu",
                 counters: Any = None, min_excess_s: float = MIN_STALL_EXCESS_S) -> None:
        self.steps_total = steps_total
        self.device = torch.device(device)
        self.min_excess_s = min_excess_s
        self._counters = counters or (lambda: stall_counters(self.device))
        self._last = self._counters()
        self._seen = 0
        self._times: collections.deque[float] = collections.deque(maxlen=_MEDIAN_WINDOW)
        self._loads: dict[str, collections.deque[float]] = {}

    def observe(self, step: int, timing: StepTiming, load: dict[str, float] | None = None) -> dict[str, Any]:
        now = self._counters()
        before, self._last = self._last, now
        step_s = timing.step_ms / 1000.0
        self._seen += 1
        out: dict[str, Any] = {"steps_total": self.steps_total}
        median = statistics.median(self._times) if self._times else None
        if median is not None and step_s > STALL_FACTOR * median and step_s - median >= self.min_excess_s:
            median_load = {k: statistics.median(v) for k, v in self._loads.items() if v}
            out["stall"] = stall_cause(before, now, timing, median, load, median_load)
        if self._seen > 1:  # the first step of a process compiles: neither the ETA nor the median has it
            self._times.append(step_s)
            for key, value in (load or {}).items():
                self._loads.setdefault(key, collections.deque(maxlen=_MEDIAN_WINDOW)).append(float(value))
        per_step = statistics.median(self._times) if self._times else step_s
        out["eta_s"] = max(0, self.steps_total - step) * per_step
        return out


class ModuleTimer:
    """Forward time of one submodule (the vision tower) within a step: CUDA events (or the wall
    clock on the CPU) around each of its forward calls, summed until :meth:`take`. Read after
    the profiler's ``end_step`` (which synchronises), so it costs no extra synchronisation.

    With it, the tower's own forward MFU (its forward FLOPs over its forward time) stands beside
    the trunk's: a tower at 5% of the FLOPs and 17% of the step shows there."""

    def __init__(self, module: torch.nn.Module, device: torch.device | str = "cpu") -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._open: list[Any] = []
        self._spans: list[tuple[Any, Any]] = []
        module.register_forward_pre_hook(self._pre)
        module.register_forward_hook(self._post)

    def _now(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _pre(self, *_: Any) -> None:
        self._open.append(self._now())

    def _post(self, *_: Any) -> None:
        if self._open:
            self._spans.append((self._open.pop(), self._now()))

    def take(self) -> float:
        """Milliseconds of forward since the last take (0.0 when the module did not run)."""
        spans, self._spans, self._open = self._spans, [], []
        if self.cuda:
            return float(sum(a.elapsed_time(b) for a, b in spans))
        return float(sum((b - a) * 1e3 for a, b in spans))


# ----------------------------------------------------------------- one step under torch.profiler

# GPU kernel families by name (first match wins): where a profiled step's time goes. Names are the
# kernels' own (Triton's, TileLang's, cuBLAS', the fused losses'); what matches none is `other`
# and still shows in the top-kernels list.
KERNEL_FAMILIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("copy", ("memcpy", "memset")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("conv (causal conv1d)", ("conv1d", "causal_conv")),
    ("loss head (cross-entropy)", ("cce", "cross_entropy", "indexed_neg_dot", "lse", "ce_dz", "crossentropy")),
    ("GDN (fla / FlashQLA)", ("chunk", "gated_delta", "gdn", "recompute_w_u", "solve_tril", "wy_", "l2norm",
                             "fused_recurrent", "merge_16x16", "cumsum", "qla", "tilelang", "main_kernel")),
    # the DFlash drafter's compiled flex_attention is an Inductor template kernel (triton_tem_*)
    ("attention", ("flash", "fmha", "attn", "varlen", "sdpa", "flex", "triton_tem")),
    ("matmul", ("gemm", "xmma", "cutlass", "cublas", "nvjet", "sm90_", "sm80_", "gemv", "wgmma",
                "aten::mm", "aten::bmm", "aten::addmm", "aten::linear")),
    ("compiled elementwise (inductor)", ("triton_",)),
    ("norm / activation", ("norm", "silu", "gelu", "softmax", "rotary", "rope")),
)


def kernel_family(name: str) -> str:
    low = name.lower()
    for family, keys in KERNEL_FAMILIES:
        if any(k in low for k in keys):
            return family
    return "other"


def profile_activities(device: torch.device) -> list:
    """What to record: the GPU's kernels on CUDA, the CPU's ops otherwise."""
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]


def kernel_table(prof, what: str, device: torch.device, top: int = 12) -> list[str]:
    """A finished torch.profiler's time by kernel family and its top kernels, as markdown lines
    (on CUDA the GPU kernels' own time; on a CPU the ops' self time)."""
    on_gpu = device.type == "cuda"
    rows = []
    for e in prof.key_averages():
        if on_gpu and not str(getattr(e, "device_type", "")).endswith("CUDA"):
            continue
        us = float(getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0)) if on_gpu \
            else float(e.self_cpu_time_total)
        if us > 0:
            rows.append((e.key, us, int(e.count)))
    total = sum(us for _, us, _ in rows)
    if not total:
        return [f"# profile of {what}: no {'GPU kernel' if on_gpu else 'CPU op'} time recorded"]
    families: dict[str, float] = collections.defaultdict(float)
    for name, us, _ in rows:
        families[kernel_family(name)] += us
    kind = "GPU kernel time" if on_gpu else "CPU op self time"
    lines = [f"# profile of {what}: {total / 1000:.1f} ms {kind} (torch.profiler; this step's own time is inflated by it)",
             "| family | ms | share |", "|---|---:|---:|"]
    lines += [f"| {fam} | {us / 1000:.1f} | {us / total:.1%} |" for fam, us in sorted(families.items(), key=lambda x: -x[1])]
    lines += [f"top {top}:", "| kernel | family | calls | ms | share |", "|---|---|---:|---:|---:|"]
    for name, us, n in sorted(rows, key=lambda x: -x[1])[:top]:
        short = name if len(name) <= 90 else name[:87] + "..."
        lines.append(f"| `{short.replace('|', '/')}` | {kernel_family(name)} | {n} | {us / 1000:.1f} | {us / total:.1%} |")
    return lines
