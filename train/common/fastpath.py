"""Fast-path policy: which kernels each token mixer uses, and refusing to train slowly by accident.

Seen on real runs: without flash-linear-attention (fla) or a varlen causal conv, the GDN layers fall
back to a slow torch path and the GPUs sit at 16-22%. transformers makes it worse: it catches a
FAILED ``import fla`` (for example a missing ``libz3.so.4.15`` that tilelang needs) and reports fla
as "not installed". So this module imports the kernels itself and keeps the real exception.

Policy (:func:`select_kernels`):

* CPU: the project's reference kernels (:mod:`train.common.reference_kernels`), varlen-correct.
* CUDA: fla's ``chunk_gated_delta_rule`` for the recurrence, and a varlen causal conv:
  ``causal_conv1d.causal_conv1d_fn`` (with ``seq_idx``) or, when that is absent, fla's Triton
  ``causal_conv1d`` (with ``cu_seqlens``) through an adapter. Either missing -> :class:`FastPathError`
  naming the missing piece and the import exception, before step 1. ``conv`` (``--conv-impl``)
  picks one of the two explicitly: ``fla`` needs no nvcc-built package at all, so causal-conv1d
  is optional.
* CUDA on Hopper (sm_90) with Triton >= 3.4, < 3.7.1: fla's gated backward is wrong there unless its
  tilelang backend is usable (tilelang imports, an nvcc is found, FLA_TILELANG is not 0). Known-bad
  -> FastPathError, naming the fix.
* The header names fla's gated-delta-rule backend (:func:`gdn_backend`): FlashQLA when the
  ``flash-qla`` package is installed (the gpu extra has it; ~5% faster steps on an H200), else
  fla's Triton kernels.
* The job's other kernels, when it names them: the loss (``loss``: a fused cross-entropy kernel on
  CUDA, :func:`train.common.losses.select_loss_impl`: cut-cross-entropy by default, Liger's
  Hopper kernel as ``liger-sm90``, both pinned in the GPU locks) and the full attention
  (``attention``: torch's varlen kernel, :mod:`train.common.varlen_attention`).
* Every choice that falls back from what the GPU locks provide (fla's GDN, the FlashQLA backend on
  the GPUs it serves, a varlen conv, a fused loss, varlen attention) is a :class:`Fallback`, and a
  CUDA start with any is refused in one line naming the missing package and its install command
  at the lock's pin (:data:`LOCK_PINS`). An explicit choice (``--loss-impl logits``, ``--attention
  sdpa``, ``FLA_FLASH_QLA=0``) is not a fallback: the header names it.
* ``allow_slow_path=True`` (``--allow-slow-path``) turns every refusal into a loud banner on stderr
  and header lines naming each fallback and its measured cost, and uses the reference kernels for
  the pieces that are missing or known-bad. It is the only way past.

Full attention needs no kernel choice: with ``position_ids`` that restart per document and no 2D
attention mask, transformers builds a block-diagonal causal mask for sdpa/eager; flash-attention-2
reads ``cu_seq_lens_q/k`` instead. :func:`install_kernels` swaps every GDN layer to
:class:`train.common.packed_gdn.PackedGatedDeltaNet` with the chosen functions.
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from train.common import reference_kernels

SLOW_PATH_FLAG = "--allow-slow-path"
CONV_CHOICES = ("auto", "causal-conv1d", "fla")


class FastPathError(RuntimeError):
    """The optimized kernels are not usable; the message says which piece and why."""


@dataclass(frozen=True)
class Probe:
    """Outcome of really importing ``module`` (and fetching ``attr`` from it)."""

    target: str
    ok: bool
    error: str | None = None
    obj: object = field(default=None, repr=False, compare=False)


def probe_import(module: str, attr: str | None = None) -> Probe:
    target = f"{module}.{attr}" if attr else module
    try:
        mod = importlib.import_module(module)
        obj = getattr(mod, attr) if attr else mod
    except Exception as exc:  # any import-time failure is the thing to report, not just ImportError
        return Probe(target, False, f"{type(exc).__name__}: {exc}")
    return Probe(target, True, obj=obj)


# The kernel packages of the GPU locks (images/trainer/requirements-gpu.lock and -cp312.lock) at
# their pins: what a refusal tells the user to install. tests/test_fastpath.py holds these to
# both locks, so a lock bump that forgets this table fails there.
LOCK_PINS = {
    "flash-linear-attention": "0.6.0",
    "fla-core": "0.6.0",
    "flash-qla": "0.1.3",
    "tilelang": "0.1.15",
    "z3-solver": "4.15.4.0",
    "cut-cross-entropy": "25.1.1",
    "liger-kernel": "0.8.5",
    "nvidia-cutlass-dsl": "4.8.1",
}

# What each fallback cost where it was measured (bench/RESULTS.md, one H200, the 2B shape).
FALLBACK_COST = {
    "gdn": "reference torch GDN/conv: 1,583 tok/s against 23,525 on the fast path (bench/RESULTS.md, naive vs fast)",
    "gdn-backend": "fla's Triton GDN: 49.7% MFU against 52.2% with FlashQLA side by side (~5% slower steps)",
    "loss": "full logits: ~5% slower steps and ~1.7x the peak memory (114.1 GiB against 68.9, bench/RESULTS.md run F)",
    "attention": "sdpa per document: a kernel launch per document and head group; not measured alone",
}

# GPUs whose training (fwd + bwd) fla hands to FlashQLA when flash-qla imports: SM90 and
# SM100/SM103 (fla's FlashQLABackend; SM120 has a forward kernel only).
FLASH_QLA_CAPABILITIES = frozenset({(9, 0), (10, 0), (10, 3)})


def pip_install(*dists: str) -> str:
    """`pip install 'name==pin' ...` at the GPU locks' pins."""
    return "pip install " + " ".join(f"'{d}=={LOCK_PINS[d]}'" for d in dists)


def _one_line(text: str | None) -> str:
    return " ".join((text or "").split())


@dataclass(frozen=True)
class Fallback:
    """One kernel choice that falls back from what the GPU locks provide."""

    piece: str  # gated delta rule | gated-delta-rule backend | causal conv | loss | attention
    instead: str  # what runs instead
    missing: str  # the package that is missing or broken, with the probe's error
    install: str  # the command that installs it
    cost: str  # what the fallback was measured to cost

    def refusal(self) -> str:
        return _one_line(f"{self.piece}: {self.missing}; install: {self.install}")

    def header(self) -> str:
        return _one_line(f"{self.piece}: {self.instead} ({self.missing}); measured cost: {self.cost}")


@dataclass(frozen=True)
class KernelChoice:
    device: str
    gdr: str  # which implementation the gated delta rule uses
    conv: str  # which implementation the short causal conv uses
    attention: str
    slow_path: bool
    problems: tuple[str, ...] = ()
    gdr_fn: Callable[..., torch.Tensor] = field(default=reference_kernels.chunk_gated_delta_rule_varlen, repr=False)
    conv_fn: Callable[..., torch.Tensor] = field(default=reference_kernels.causal_conv1d_varlen, repr=False)
    fallbacks: tuple[Fallback, ...] = ()
    loss_impl: str | None = None  # the loss kernel (None: the job has no loss here)
    attention_impl: str | None = None  # varlen | sdpa (None: not the job's choice here)
    gdn: bool = True  # whether the GDN/conv kernels are part of this job's set
    gdn_backend: str | None = None  # fla's gated-delta-rule backend (None: fla not used)

    def header(self) -> str:
        """The lines the trainer prints in its log header."""
        pieces = [f"gated-delta-rule={self.gdr}", f"causal-conv={self.conv}"] if self.gdn else []
        pieces.append(f"attention={self.attention}")
        if self.loss_impl is not None:
            pieces.append(f"loss={self.loss_impl}")
        lines = [f"kernels[{self.device}]: " + " | ".join(pieces)]
        if self.slow_path:
            lines.append(f"kernels: SLOW PATH ({SLOW_PATH_FLAG}), {len(self.fallbacks) or len(self.problems)} fallback(s):")
            lines += [f"kernels:   {f.header()}" for f in self.fallbacks] or [f"kernels:   {p}" for p in self.problems]
        return "\n".join(lines)


# ----------------------------------------------------------------------------- adapters (CUDA)


class _Offsets:
    """``cu_seqlens`` as fla takes it, made once per batch: int64 on the device plus a CPU copy.

    Every GDN layer of a step gets the same int32 ``cu_seqlens`` tensor. A fresh ``.long()`` per
    layer would miss fla's one-entry tensor cache (it keys on the tensor object), and without
    ``cu_seqlens_cpu`` fla reads the offsets back from the GPU in every layer, forward and
    backward: a host sync each time, which drains the launch queue of a launch-bound step.
    """

    def __init__(self) -> None:
        self._ref: weakref.ref | None = None
        self._value: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._ref is not None and self._ref() is cu_seqlens and self._value is not None:
            return self._value
        as_long = cu_seqlens.long()
        self._ref, self._value = weakref.ref(cu_seqlens), (as_long, as_long.cpu())
        return self._value


_offsets = _Offsets()


def _fla_gdr_adapter(chunk_gated_delta_rule: Callable) -> Callable[..., torch.Tensor]:
    def fla_chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=None, use_qk_l2norm_in_kernel=False, **_):
        batch, seq_len = q.shape[:2]
        if cu_seqlens is None:
            cu_seqlens = reference_kernels.row_cu_seqlens(batch, seq_len, q.device)
        # fla's varlen mode wants the batch flattened to one sequence and int64 offsets
        flat = [x.reshape(1, batch * seq_len, *x.shape[2:]) for x in (q, k, v, g, beta)]
        cu_long, cu_cpu = _offsets(cu_seqlens)
        out, _ = chunk_gated_delta_rule(
            *flat, cu_seqlens=cu_long, cu_seqlens_cpu=cu_cpu, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel
        )
        return out.reshape(batch, seq_len, *out.shape[2:])

    return fla_chunk_gated_delta_rule


def _causal_conv1d_adapter(causal_conv1d_fn: Callable) -> Callable[..., torch.Tensor]:
    def causal_conv1d_cuda(x, weight, bias=None, activation=None, seq_idx=None, **_):
        # causal-conv1d takes seq_idx only with a channel-last x, which in_proj(...).transpose(1, 2) is
        return causal_conv1d_fn(x, weight, bias, seq_idx=seq_idx, activation=activation)

    return causal_conv1d_cuda


def _fla_conv_adapter(fla_causal_conv1d: Callable) -> Callable[..., torch.Tensor]:
    def fla_triton_causal_conv1d(x, weight, bias=None, activation=None, cu_seqlens=None, **_):
        batch, dim, seq_len = x.shape
        flat = x.transpose(1, 2).reshape(1, batch * seq_len, dim)  # fla: [B, T, D], varlen needs B == 1
        offsets = {} if cu_seqlens is None else dict(zip(("cu_seqlens", "cu_seqlens_cpu"), _offsets(cu_seqlens),
                                                         strict=True))
        out, _ = fla_causal_conv1d(flat, weight, bias, activation=activation, **offsets)
        return out.reshape(batch, seq_len, dim).transpose(1, 2)

    return fla_triton_causal_conv1d


# ----------------------------------------------------------------------------- policy


def _triton_version() -> str | None:
    probe = probe_import("triton")
    return getattr(probe.obj, "__version__", None) if probe.ok else None


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def tilelang_problem() -> str | None:
    """Why fla's tilelang backend would not be used, or None if it would."""
    if os.environ.get("FLA_TILELANG", "1") == "0" or os.environ.get("FLA_DISABLE_BACKEND_DISPATCH") == "1":
        return "tilelang disabled by FLA_TILELANG=0 or FLA_DISABLE_BACKEND_DISPATCH=1"
    probe = probe_import("tilelang")
    if not probe.ok:
        return f"import tilelang failed: {probe.error}"
    nvcc = probe_import("fla.utils", "has_usable_nvcc")
    has_nvcc = nvcc.obj() if nvcc.ok else shutil.which("nvcc") is not None
    if not has_nvcc:
        return "tilelang imports but no nvcc was found for its JIT (set CUDA_HOME or install nvidia-cuda-nvcc)"
    return None


def configure_tilelang_cache(env: dict[str, str] | None = None) -> str | None:
    """Put TileLang's kernel cache (FlashQLA's and fla's tilelang kernels) beside Triton's
    node-local one unless TILELANG_CACHE_DIR is set, so the next job on the node starts warm (its
    default is ~/.tilelang/cache, the home directory: often a network file system). Before the
    first ``import tilelang``."""
    env = os.environ if env is None else env
    if not env.get("TILELANG_CACHE_DIR") and env.get("TRITON_CACHE_DIR"):
        env["TILELANG_CACHE_DIR"] = os.path.join(os.path.dirname(env["TRITON_CACHE_DIR"].rstrip("/")), "tilelang")
    return env.get("TILELANG_CACHE_DIR")


def gdn_backend(capability: tuple[int, int] | None) -> str:
    """Which of fla's gated-delta-rule backends a call with K = V = 128 heads (the Qwen3.5 shapes')
    takes: fla dispatches to the first registered backend whose package imports and whose env
    switch is on (FlashQLA: the `flash-qla` package, FLA_FLASH_QLA; fused TileLang fwd + bwd on
    Hopper/Blackwell), else its own Triton kernels (whose gated backward takes tilelang on
    Hopper when it is usable)."""
    default = "triton" + (" (tilelang gated backward)" if capability == (9, 0) and tilelang_problem() is None else "")
    registry = probe_import("fla.backends", "_load_operation_registry")
    if not registry.ok:
        return default
    try:
        active = registry.obj("gated_delta_rule").get_active()
    except Exception as exc:  # a backend package that fails its import: fla falls back to Triton too
        return f"{default}; backend registry failed: {type(exc).__name__}: {exc}"
    if active is None:
        return default + ("; flash-qla not installed (the faster FlashQLA backend for Hopper)"
                          if capability == (9, 0) else "")
    return {"flash_qla": "flash_qla (FlashQLA, fused TileLang)"}.get(active.backend_type, active.backend_type)


def hopper_problem(capability: tuple[int, int] | None, triton_version: str | None) -> str | None:
    """The known-bad Hopper + Triton [3.4, 3.7.1) + no usable tilelang combination, or None."""
    if capability != (9, 0) or triton_version is None:
        return None
    if not ((3, 4, 0) <= _version_tuple(triton_version) < (3, 7, 1)):
        return None
    why = tilelang_problem()
    if why is None:
        return None
    return (
        f"known-bad: fla's gated backward on Hopper (sm_90) with triton {triton_version} gives wrong gradients "
        f"and no tilelang backend is usable ({why}); fix: triton>=3.7.1, or a working tilelang "
        "(tilelang needs libz3 from the z3-solver wheel on LD_LIBRARY_PATH)"
    )


def _slow_path_banner(fallbacks: list[Fallback]) -> None:
    bar = "!" * 100
    lines = [bar, f"!! {SLOW_PATH_FLAG}: TRAINING ON THE SLOW PATH (kernels the GPU locks provide are missing).",
             "!! Fallbacks:"]
    lines += [f"!!   - {f.header()}" for f in fallbacks]
    lines += ["!! Remove the flag to make this an error.", bar]
    print("\n".join(lines), file=sys.stderr, flush=True)


def refuse_or_announce(fallbacks: list[Fallback], allow_slow_path: bool) -> None:
    """No fallback: nothing. Otherwise FastPathError in one line naming each missing package and
    its install command, or, with ``allow_slow_path``, the banner on stderr."""
    if not fallbacks:
        return
    if not allow_slow_path:
        raise FastPathError(_one_line(
            "refusing to train on the slow path on a GPU: " + " | ".join(f.refusal() for f in fallbacks)
            + f" (or pass {SLOW_PATH_FLAG} to train on it anyway)"))
    _slow_path_banner(fallbacks)


def loss_fallback(device: torch.device, requested: str, uniform_loss: bool = False) -> tuple[str, Fallback | None]:
    """The loss kernel for ``requested`` on ``device`` (:func:`train.common.losses.select_loss_impl`,
    whose probes really import the kernels), and the fallback when ``auto`` on CUDA found none."""
    from train.common import losses

    impl = losses.select_loss_impl(device, requested, uniform_weights=uniform_loss)
    if device.type != "cuda" or requested != "auto" or impl != "logits":
        return impl, None
    return impl, Fallback(
        "loss", "full logits over the vocab (no fused cross-entropy kernel)",
        f"cut-cross-entropy does not import ({losses.fused_kernel_problems()})",
        pip_install("cut-cross-entropy"), FALLBACK_COST["loss"])


def attention_fallback(device: torch.device, requested: str) -> tuple[str, Fallback | None]:
    """The full-attention choice (varlen | sdpa) and the fallback when varlen on CUDA would run sdpa
    per document: torch's varlen kernel does not import, or (on a real GPU) fails its first use."""
    from train.common import varlen_attention

    choice = varlen_attention.select_attention(requested, device)
    if device.type != "cuda" or choice != "varlen":
        return choice, None
    probe = probe_import("torch.nn.attention.varlen", "varlen_attn")
    problem = probe.error
    if probe.ok and torch.cuda.is_available():
        problem = varlen_attention.check_torch_varlen(device)
    if problem is None:
        return choice, None
    return choice, Fallback(
        "attention", "sdpa per document over cu_seqlens (torch's varlen kernel not used)",
        f"torch.nn.attention.varlen.varlen_attn: {problem}",
        "pip install 'torch>=2.10' (a CUDA build; its varlen kernel)", FALLBACK_COST["attention"])


def gdn_backend_fallback(capability: tuple[int, int] | None, backend: str) -> Fallback | None:
    """FlashQLA on the GPUs it trains on, unless fla's dispatch to it is switched off on purpose."""
    if capability not in FLASH_QLA_CAPABILITIES or backend.startswith("flash_qla"):
        return None
    if os.environ.get("FLA_FLASH_QLA", "1") == "0" or os.environ.get("FLA_DISABLE_BACKEND_DISPATCH") == "1":
        return None  # asked for: the header's backend names it
    probe = probe_import("flash_qla")
    missing = (f"flash-qla does not import ({probe.error})" if not probe.ok
               else f"flash-qla imports but fla does not dispatch to it ({backend})")
    return Fallback("gated-delta-rule backend", "fla's Triton kernels instead of FlashQLA", missing,
                    pip_install("flash-qla", "tilelang", "z3-solver"), FALLBACK_COST["gdn-backend"])


def select_kernels(
    device: str | torch.device,
    allow_slow_path: bool = False,
    *,
    capability: tuple[int, int] | None = None,
    triton_version: str | None = None,
    conv: str = "auto",
    loss: str | None = None,
    attention: str | None = None,
    gdn: bool = True,
    uniform_loss: bool = False,
) -> KernelChoice:
    """Decide which implementation each kernel of the job uses on ``device`` (:func:`plan_kernels`),
    and refuse (or, with ``allow_slow_path``, announce) every fallback from the GPU locks' fast path."""
    choice = plan_kernels(device, capability=capability, triton_version=triton_version, conv=conv, loss=loss,
                          attention=attention, gdn=gdn, uniform_loss=uniform_loss)
    refuse_or_announce(list(choice.fallbacks), allow_slow_path)
    return choice


def plan_kernels(
    device: str | torch.device,
    *,
    capability: tuple[int, int] | None = None,
    triton_version: str | None = None,
    conv: str = "auto",
    loss: str | None = None,
    attention: str | None = None,
    gdn: bool = True,
    uniform_loss: bool = False,
) -> KernelChoice:
    """Which implementation each kernel of the job uses on ``device`` (see module docstring), with
    every fallback from the GPU locks' fast path listed in ``fallbacks``; refuses nothing.

    ``conv``: ``auto`` (causal-conv1d when it imports, else fla's Triton conv), ``causal-conv1d``
    or ``fla`` (that one only; missing -> refused like any missing kernel).
    ``loss``: the job's ``--loss-impl`` (None: the job computes no loss here, e.g. extraction).
    ``attention``: the job's ``--attention`` for the full-attention layers (None: not a choice here).
    ``gdn``: False where the job runs no GDN layers on this rank (the DFlash drafter).
    ``uniform_loss``: the job's loss weighs every target token alike (stage-1), so ``auto`` may take
    a liger-sm90 kernel (:data:`train.common.losses.SM90_PREFERENCE`).

    ``capability``/``triton_version`` default to the real GPU's and the installed Triton's; tests
    pass them, with ``device="cuda"``, to exercise the CUDA policy on a CPU machine: every import
    probe is real.
    """
    if conv not in CONV_CHOICES:
        raise ValueError(f"unknown conv implementation {conv!r} ({', '.join(CONV_CHOICES)})")
    dev = torch.device(device)
    fallbacks: list[Fallback] = []
    loss_impl, loss_fb = loss_fallback(dev, loss, uniform_loss) if loss is not None else (None, None)
    attention_impl, attention_fb = attention_fallback(dev, attention) if attention is not None else (None, None)
    if dev.type != "cuda":
        return KernelChoice(
            device=dev.type,
            gdr="reference.chunk_gated_delta_rule_varlen (fp32, torch)",
            conv="reference.causal_conv1d_varlen (torch)",
            attention="sdpa, block-diagonal causal mask from position_ids",
            slow_path=False, loss_impl=loss_impl, attention_impl=attention_impl, gdn=gdn,
        )

    gdr_fn: Callable[..., torch.Tensor] = reference_kernels.chunk_gated_delta_rule_varlen
    conv_fn: Callable[..., torch.Tensor] = reference_kernels.causal_conv1d_varlen
    gdr_name = conv_name = "not used on this rank"
    backend = None
    if gdn:
        gdr_fn, gdr_name, conv_fn, conv_name, backend = _select_gdn(dev, capability, triton_version, conv, fallbacks)
    fallbacks += [f for f in (loss_fb, attention_fb) if f is not None]
    return KernelChoice(
        device="cuda",
        gdr=gdr_name,
        conv=conv_name,
        attention=("sdpa, block-diagonal causal mask from position_ids (flash_attention_2: cu_seq_lens)"
                   if attention_impl is None else attention_impl),
        slow_path=bool(fallbacks),
        problems=tuple(f.refusal() for f in fallbacks),
        gdr_fn=gdr_fn,
        conv_fn=conv_fn,
        fallbacks=tuple(fallbacks),
        loss_impl=loss_impl,
        attention_impl=attention_impl,
        gdn=gdn,
        gdn_backend=backend,
    )


def _select_gdn(dev: torch.device, capability: tuple[int, int] | None, triton_version: str | None, conv: str,
                fallbacks: list[Fallback]) -> tuple[Callable, str, Callable, str, str | None]:
    """The GDN recurrence's and the short conv's kernels on CUDA; appends their fallbacks."""
    fla_install = pip_install("flash-linear-attention", "fla-core")
    configure_tilelang_cache()
    fla_pkg = probe_import("fla")
    gdr = probe_import("fla.ops.gated_delta_rule", "chunk_gated_delta_rule") if fla_pkg.ok else fla_pkg
    if gdr.ok:
        gdr_fn, gdr_name = _fla_gdr_adapter(gdr.obj), "fla.ops.gated_delta_rule.chunk_gated_delta_rule"
    else:
        fallbacks.append(Fallback(
            "gated delta rule", "the reference torch kernel",
            f"flash-linear-attention is not usable: {gdr.target}: {gdr.error}", fla_install, FALLBACK_COST["gdn"]))
        gdr_fn, gdr_name = reference_kernels.chunk_gated_delta_rule_varlen, "reference (SLOW)"

    cc = probe_import("causal_conv1d", "causal_conv1d_fn")
    fla_conv = probe_import("fla.modules.causal_conv1d", "causal_conv1d") if fla_pkg.ok else fla_pkg
    if conv == "fla":
        cc = Probe(cc.target, False, "not wanted (--conv-impl fla)")
    elif conv == "causal-conv1d":
        fla_conv = Probe(fla_conv.target, False, "not wanted (--conv-impl causal-conv1d)")
    if cc.ok:
        conv_fn, conv_name = _causal_conv1d_adapter(cc.obj), "causal_conv1d.causal_conv1d_fn (seq_idx)"
    elif fla_conv.ok:
        conv_fn, conv_name = _fla_conv_adapter(fla_conv.obj), "fla.modules.causal_conv1d.causal_conv1d (triton, cu_seqlens)"
    else:
        fallbacks.append(Fallback(
            "causal conv", "the reference torch conv",
            "varlen causal conv: neither causal-conv1d nor fla's Triton causal_conv1d is usable: "
            f"{cc.target}: {cc.error}; {fla_conv.target}: {fla_conv.error}",
            f"{fla_install} (its Triton causal_conv1d takes cu_seqlens)", FALLBACK_COST["gdn"]))
        conv_fn, conv_name = reference_kernels.causal_conv1d_varlen, "reference (SLOW)"

    backend = None
    if gdr.ok:
        if capability is None and torch.cuda.is_available():  # else unknown: no per-architecture policy
            capability = torch.cuda.get_device_capability(dev)
        if triton_version is None:
            triton_version = _triton_version()
        bad = hopper_problem(capability, triton_version)
        if bad:
            fallbacks.append(Fallback("gated delta rule", "the reference torch kernel", bad,
                                      f"{pip_install('tilelang', 'z3-solver')}, or pip install 'triton>=3.7.1'",
                                      FALLBACK_COST["gdn"]))
            gdr_fn, gdr_name = reference_kernels.chunk_gated_delta_rule_varlen, "reference (SLOW, Hopper/Triton known-bad)"
        else:
            backend = gdn_backend(capability)
            gdr_name += f" [backend: {backend}]"
            backend_fb = gdn_backend_fallback(capability, backend)
            if backend_fb is not None:
                fallbacks.append(backend_fb)
    return gdr_fn, gdr_name, conv_fn, conv_name, backend


# The kernel set of each bundled trainer, as plan_kernels' arguments (`launch doctor --job`
# checks the set of the job's entrypoint). DFlash: the drafter's loss, and the online target
# ranks' GDN and conv (an offline run needs only the loss; the doctor checks the union).
JOB_KERNELS: dict[str, dict[str, str]] = {
    "train.stage1": {"loss": "auto", "attention": "auto"},
    "train.dflash": {"loss": "auto"},
    "train.extract": {},
    "train.regen": {},
}


# The trainers' arguments that pick a kernel (a job preset may set them), as plan_kernels' names.
KERNEL_ARGS = {"loss_impl": "loss", "attention": "attention", "conv_impl": "conv"}


def kernel_rows(entrypoint: str, device: str = "cuda", capability: tuple[int, int] | None = None,
                choices: dict[str, str] | None = None) -> list[dict[str, str | bool]] | None:
    """One row per kernel of ``entrypoint``'s set on ``device``, through :func:`plan_kernels` (the
    trainer's own probes): piece, ok, chosen, and for a fallback what is missing, its install
    command and its measured cost. ``choices``: the job's kernel arguments (KERNEL_ARGS' keys, as
    its spec or preset sets them). None for an entrypoint that is not a bundled trainer."""
    if entrypoint not in JOB_KERNELS:
        return None
    kwargs = dict(JOB_KERNELS[entrypoint])
    for arg, value in (choices or {}).items():
        name = KERNEL_ARGS.get(arg)
        if name and (name in kwargs or name == "conv") and isinstance(value, str):
            kwargs[name] = value
    choice = plan_kernels(device, capability=capability, **kwargs)
    chosen = {"gated delta rule": choice.gdr, "gated-delta-rule backend": choice.gdn_backend or "-",
              "causal conv": choice.conv}
    pieces = list(chosen) if choice.gdn else []
    if choice.loss_impl is not None:
        pieces.append("loss")
        chosen["loss"] = choice.loss_impl
    if choice.attention_impl is not None:
        pieces.append("attention")
        chosen["attention"] = choice.attention_impl
    rows = []
    for piece in pieces:
        fbs = [f for f in choice.fallbacks if f.piece == piece]
        row: dict[str, str | bool] = {"piece": piece, "ok": not fbs, "chosen": _one_line(chosen[piece])}
        if fbs:
            row.update(chosen=_one_line(fbs[0].instead), missing=" | ".join(_one_line(f.missing) for f in fbs),
                       install=fbs[0].install, cost=fbs[0].cost)
        rows.append(row)
    return rows


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().float(), want.detach().float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))


def verify_kernels(
    choice: KernelChoice,
    device: torch.device | str,
    *,
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    conv_width: int,
    tolerance: float = 5e-2,
    bf16_tolerance: float = 1e-1,
) -> None:
    """Run the chosen kernels once on a small packed input (3 documents, fwd + bwd) and compare
    them with the reference kernels. Catches what an import check cannot: a Triton that cannot
    JIT ("Failed to find C compiler"), fla's Hopper backward guard, or a kernel that lets state
    leak across documents. Raises :class:`FastPathError` naming the piece and the exception.
    """
    dev = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    lengths = [37, 64, 99]
    total = sum(lengths)
    cu_seqlens = torch.tensor([0, 37, 101, 200], dtype=torch.int32, device=dev)
    seq_idx = reference_kernels.cu_seqlens_to_seq_idx(cu_seqlens, total).view(1, total)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dev).requires_grad_()

    q, k = rand(1, total, num_k_heads, head_k_dim), rand(1, total, num_k_heads, head_k_dim)
    v = rand(1, total, num_v_heads, head_v_dim)
    g = (-torch.nn.functional.softplus(torch.randn(1, total, num_v_heads, generator=gen))).to(dev).requires_grad_()
    beta = torch.rand(1, total, num_v_heads, generator=gen).to(dev).requires_grad_()
    conv_dim = 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim
    x = rand(1, total, conv_dim).transpose(1, 2)  # channel-last, as in the layer
    weight = rand(conv_dim, conv_width)

    checks = (
        ("gated delta rule", choice.gdr, choice.gdr_fn, reference_kernels.chunk_gated_delta_rule_varlen,
         (q, k, v, g, beta), {"cu_seqlens": cu_seqlens, "use_qk_l2norm_in_kernel": True}),
        ("causal conv", choice.conv, choice.conv_fn, reference_kernels.causal_conv1d_varlen,
         (x, weight, None, "silu"), {"seq_idx": seq_idx, "cu_seqlens": cu_seqlens}),
    )
    for piece, name, fast_fn, ref_fn, args, kwargs in checks:
        if fast_fn is not ref_fn:
            _check_kernel(piece, name, fast_fn, ref_fn, args, kwargs, tolerance)
    if choice.device == "cuda" and choice.gdr_fn is not reference_kernels.chunk_gated_delta_rule_varlen:
        # Training runs in bf16, and fla dispatches by dtype (FlashQLA takes only bf16/fp16), so the
        # kernel that trains is checked too: bf16 inputs, against the reference on the same rounded
        # values in fp32.
        # as the layer gives them: q, k, v, beta in bf16, the decay g in fp32 (packed_gdn.py)
        rounded = [a.detach().to(torch.float32 if a is g else torch.bfloat16) for a in (q, k, v, g, beta)]
        low = [a.clone().requires_grad_() for a in rounded]
        high = [a.float().requires_grad_() for a in rounded]
        _check_kernel("gated delta rule (bf16)", choice.gdr, choice.gdr_fn, reference_kernels.chunk_gated_delta_rule_varlen,
                      tuple(low), checks[0][5], bf16_tolerance, ref_args=tuple(high))


def _check_kernel(piece: str, name: str, fast_fn: Callable, ref_fn: Callable, args: tuple, kwargs: dict,
                  tolerance: float, ref_args: tuple | None = None) -> None:
    ref_args = args if ref_args is None else ref_args
    leaves = [a for a in args if torch.is_tensor(a) and a.requires_grad]
    ref_leaves = [a for a in ref_args if torch.is_tensor(a) and a.requires_grad]
    want = ref_fn(*ref_args, **kwargs)
    want_grads = torch.autograd.grad(want.float().square().sum(), ref_leaves)
    try:
        got = fast_fn(*args, **kwargs)
        if not torch.is_tensor(got) or got.shape != want.shape:
            raise TypeError(f"returned {type(got).__name__} {getattr(got, 'shape', '')}, expected {tuple(want.shape)}")
        got_grads = torch.autograd.grad(got.float().square().sum(), leaves)
    except Exception as exc:
        raise FastPathError(f"{piece} kernel {name} failed its first call: {type(exc).__name__}: {exc}") from exc
    errors = [_relative_error(got, want)] + [_relative_error(a, b) for a, b in zip(got_grads, want_grads, strict=True)]
    if max(errors) > tolerance:
        raise FastPathError(
            f"{piece} kernel {name} disagrees with the varlen reference on a packed input "
            f"(max relative error {max(errors):.3g} > {tolerance}; output, then input grads: "
            f"{', '.join(f'{e:.2g}' for e in errors)})"
        )


def install_kernels(model: torch.nn.Module, choice: KernelChoice, verify: bool = True) -> int:
    """Swap every qwen3_5 GDN layer in ``model`` to the packed forward with ``choice``'s kernels.

    With ``verify`` (default) and a non-CPU choice, first checks the chosen kernels against the
    reference at the model's head shapes (:func:`verify_kernels`). Returns the number of layers
    changed. Parameters and state_dict keys are untouched.
    """
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    from train.common.packed_gdn import PackedGatedDeltaNet

    layers = [m for m in model.modules() if isinstance(m, Qwen3_5GatedDeltaNet)]
    if not layers:
        raise ValueError("install_kernels: the model has no Qwen3.5 gated-delta-net layers")
    if verify and choice.device != "cpu":
        first = layers[0]
        verify_kernels(
            choice,
            first.in_proj_qkv.weight.device,
            num_k_heads=first.num_k_heads,
            num_v_heads=first.num_v_heads,
            head_k_dim=first.head_k_dim,
            head_v_dim=first.head_v_dim,
            conv_width=first.conv_kernel_size,
        )
    for module in layers:
        module.__class__ = PackedGatedDeltaNet
        module.conv_impl = choice.conv_fn
        module.gdr_impl = choice.gdr_fn
    return len(layers)


# ----------------------------------------------------------------------------- warm-up


def warm_layouts(stream_len: int, max_doc: int) -> list[list[int]]:
    """Document lengths of the streams :func:`warm_kernels` runs: what a run's batches range over
    (streams of only full-length documents, of many short ones, and mixed), so that every kernel
    variant a length pattern can select (FlashQLA's intra-card split of long documents or not,
    fla's per-shape autotune) is compiled before the first timed step."""
    full = [max_doc] * (stream_len // max_doc) + ([stream_len % max_doc] if stream_len % max_doc else [])
    short = [256] * (stream_len // 256) + ([stream_len % 256] if stream_len % 256 else [])
    half = max(1, max_doc // 2)
    mixed = [max_doc - 1, 1] + [half] * ((stream_len - max_doc) // half)
    mixed += [stream_len - sum(mixed)] if stream_len > sum(mixed) else []
    return [lay for lay in (full, short, mixed) if sum(lay) == stream_len and all(n > 0 for n in lay)]


def warm_kernels(model: torch.nn.Module, choice: KernelChoice, stream_len: int, max_doc: int,
                 dtype: torch.dtype = torch.bfloat16) -> int:
    """Forward + backward of the chosen GDN and conv kernels, at the model's head shapes and the
    run's stream length, for each layout of :func:`warm_layouts`; returns how many ran. Nothing of
    the model changes (the kernels get fresh random inputs). CPU choices have nothing to compile."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    layer = next((m for m in model.modules() if isinstance(m, Qwen3_5GatedDeltaNet)), None)
    reference = (reference_kernels.chunk_gated_delta_rule_varlen, reference_kernels.causal_conv1d_varlen)
    if choice.device == "cpu" or choice.gdr_fn in reference or choice.conv_fn in reference or layer is None:
        return 0
    dev = layer.in_proj_qkv.weight.device
    hk, hv, dk, dv = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    conv_dim = 2 * hk * dk + hv * dv
    layouts = list(dict.fromkeys(map(tuple, warm_layouts(stream_len, max_doc))))
    for lengths in layouts:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        seq_idx = reference_kernels.cu_seqlens_to_seq_idx(cu, stream_len).view(1, stream_len)

        def rand(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
            return torch.randn(*shape, device=dev, dtype=dt).requires_grad_()

        q, k, v = rand(1, stream_len, hk, dk), rand(1, stream_len, hk, dk), rand(1, stream_len, hv, dv)
        g = (-torch.nn.functional.softplus(torch.randn(1, stream_len, hv, device=dev))).requires_grad_()
        beta = torch.rand(1, stream_len, hv, device=dev, dtype=dtype).requires_grad_()
        out = choice.gdr_fn(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
        out.float().square().mean().backward()
        x = rand(1, stream_len, conv_dim).transpose(1, 2)  # channel-last, as in the layer
        y = choice.conv_fn(x, rand(conv_dim, layer.conv_kernel_size), None, "silu", seq_idx=seq_idx, cu_seqlens=cu)
        y.float().square().mean().backward()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return len(layouts)
