"""Next-token loss per token, with or without materialising the full-vocab logits.

At the 2B shape a row of 8192 tokens against a ~254k vocab is 4 GB of bf16 logits, and twice
that once upcast for the softmax; the fused kernels (Cut Cross-Entropy, Liger) never build it.
Every implementation returns the same thing: the per-token loss of predicting labels[t] from
the hidden state at t-1 (labels are unshifted, see packing.py), 0 where labels[t] is ignored,
in fp32, shape [B, T-1]. The trainer reduces it per task.

Which fused kernel is the default was chosen by measurement (bench/stage1_gpu.py,
bench/RESULTS.md).
"""

from __future__ import annotations

import importlib
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F

from train.common.packing import IGNORE_INDEX

IMPLS = ("logits", "cce", "liger", "liger-sm90", "liger-sm90-tce")
# liger-sm90 with its CE pass in Triton (train/common/liger_sm90.py triton_ce_dz) instead of Liger's
SM90 = {"liger-sm90": "liger", "liger-sm90-tce": "triton"}
# Order of preference for `auto` on CUDA, fastest measured first. liger-sm90 (Liger's Hopper CuTe
# DSL kernel, train/common/liger_sm90.py) is a choice until bench/stage1_vlm_h200.sh `loss` shows it
# faster than cce on the H200.
CUDA_PREFERENCE = ("cce", "liger")
# Tried by `auto` before CUDA_PREFERENCE, on a Hopper GPU (sm_90) alone and for a loss whose per-token
# weights are all equal alone (stage-1's sum / count; DFlash weights positions): the liger-sm90
# variants, once the H200 bench shows one faster than cce. Empty until then.
SM90_PREFERENCE: tuple[str, ...] = ()


class LossImplError(RuntimeError):
    """The requested loss kernel cannot be used here."""


def _probe(impl: str) -> str | None:
    """None when `impl` imports, else the import error text (liger-sm90's names the missing package)."""
    if impl in SM90:  # Liger's SM90 kernels and the CUTLASS DSL, module by module
        from train.common.liger_sm90 import import_problem

        return import_problem(SM90[impl])
    module = {"cce": "cut_cross_entropy", "liger": "liger_kernel.transformers.functional"}.get(impl)
    if module is None:
        return None
    try:
        importlib.import_module(module)
    except Exception as exc:  # a broken triton surfaces as any exception type at import
        return f"{type(exc).__name__}: {exc}"
    return None


def fused_kernel_problems() -> str:
    """Why no fused kernel of CUDA_PREFERENCE imports, each probe's real error ('' when one does)."""
    errors = [(impl, _probe(impl)) for impl in CUDA_PREFERENCE]
    if any(err is None for _, err in errors):
        return ""
    return "; ".join(f"{impl}: {err}" for impl, err in errors)


def is_sm90(device: torch.device) -> bool:
    """Whether `device` is a Hopper GPU (compute capability 9.0), the one liger-sm90 runs on."""
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) == (9, 0)


def select_loss_impl(device: torch.device, requested: str = "auto", uniform_weights: bool = False) -> str:
    """`auto`: a fused kernel on CUDA when one imports, plain logits otherwise (and on CPU). On CUDA
    an `auto` that finds none is a fallback the trainers refuse (train.common.fastpath.loss_fallback).
    `uniform_weights`: the caller's loss weighs every target token alike (stage-1), so `auto` may
    take an SM90_PREFERENCE kernel on sm_90 (their dW is summed in the forward)."""
    if requested not in ("auto", *IMPLS):
        raise LossImplError(f"unknown loss implementation {requested!r} (auto, {', '.join(IMPLS)})")
    if requested == "auto":
        if device.type != "cuda":
            return "logits"
        first = SM90_PREFERENCE if uniform_weights and SM90_PREFERENCE and is_sm90(device) else ()
        for impl in (*first, *CUDA_PREFERENCE):
            if _probe(impl) is None:
                return impl
        return "logits"
    if requested != "logits":
        if device.type != "cuda":
            kind = "CuTe DSL" if requested in SM90 else "Triton"
            raise LossImplError(f"--loss-impl {requested} needs a CUDA device (its kernels are {kind})")
        err = _probe(requested)
        if err:
            raise LossImplError(f"--loss-impl {requested}: import failed: {err}")
        if requested in SM90 and torch.cuda.is_available() and not is_sm90(device):
            raise LossImplError(f"--loss-impl {requested} needs a Hopper GPU (sm_90): Liger's kernel is written for it alone")
    return requested


# The fused kernels' operand dtypes. cut-cross-entropy's backward asserts bf16/fp16 embeddings
# ("Backwards requires embeddings to be bf16 or fp16"), and a Triton kernel ignores autocast: a
# trainer with fp32 weights under bf16 autocast (DFlash, whose RMSNorm returns fp32) hands it fp32
# hidden states, which its forward takes and its backward refuses. Both operands go in as bf16
# (fp16 when the hidden states already are); the kernels accumulate the dot products and the
# log-sum-exp in fp32, and the loss comes back in fp32.
FUSED_DTYPES = (torch.bfloat16, torch.float16)


class _FrozenCast:
    """The bf16 copy of a frozen classifier weight (DFlash's target lm_head: fp32, requires no
    grad), made once and not per step: 248k x 2048 is a 1 GiB copy. Keyed on the tensor object
    and its in-place version counter, so a weight that changes is cast again."""

    def __init__(self) -> None:
        self._key: tuple[int, int, torch.dtype] | None = None
        self._ref: weakref.ref | None = None
        self._value: torch.Tensor | None = None

    def __call__(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        key = (id(weight), weight._version, dtype)
        if self._ref is not None and self._ref() is weight and self._key == key and self._value is not None:
            return self._value
        value = weight.detach().to(dtype)
        self._key, self._ref, self._value = key, weakref.ref(weight), value
        return value


_frozen_cast = _FrozenCast()


def fused_operands(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden [N, D], weight [V, D]) as a fused kernel takes them: both bf16 (fp16 when the hidden
    states are fp16), hidden contiguous. The casts are autograd ops, so the gradients reach fp32
    hidden states and an fp32 trainable weight in their own dtype."""
    dtype = hidden.dtype if hidden.dtype in FUSED_DTYPES else torch.bfloat16
    e = hidden.to(dtype).contiguous()
    if weight.dtype == dtype:
        c = weight
    elif weight.requires_grad:
        c = weight.to(dtype)
    else:
        c = _frozen_cast(weight, dtype)
    return e, c


def _cce(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    from cut_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(e, c, targets, ignore_index=IGNORE_INDEX, reduction="none")


def _liger(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy(e, c, targets, ignore_index=IGNORE_INDEX, reduction="none")


def _liger_sm90_token_losses(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                             prims: object = None, ce: str = "liger") -> torch.Tensor:
    """liger-sm90 over all B*T positions (a multiple of the kernel's 128-row tile at 8,192-token rows,
    and no copy of the hidden states): the last position of each row gets an ignored target, and
    its loss column is dropped. Gradients are valid for the trainer's sum/count loss only."""
    from train.common import liger_sm90

    batch, seq = labels.shape
    targets = torch.cat([labels[:, 1:], labels.new_full((batch, 1), IGNORE_INDEX)], dim=1).reshape(-1)
    e, c = fused_operands(hidden.reshape(batch * seq, hidden.shape[-1]), weight)
    try:
        out = liger_sm90.linear_cross_entropy(e, c, targets, prims, ce=ce)
    except ValueError as exc:  # a shape the kernel does not take, in one line
        raise LossImplError(str(exc)) from exc
    return out.view(batch, seq)[:, :-1]


# impl -> kernel(e [N, D], c [V, D], targets [N]) -> per-row loss [N] (0 at IGNORE_INDEX).
FUSED_KERNELS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "cce": _cce,
    "liger": _liger,
}


def reference_linear_cross_entropy(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor,
                                   chunk_rows: int = 4096) -> torch.Tensor:
    """What the fused kernels compute, in torch: the same bf16 operands, products and log-sum-exp
    in fp32, per-row loss [N] (0 at IGNORE_INDEX), in chunks of rows. The oracle the CPU tests hold
    the fused path's operands to; no faster than the logits path."""
    if e.dtype not in FUSED_DTYPES:
        # cut-cross-entropy's own assertion, kept so a CPU test fails where its backward would
        raise LossImplError(f"Backwards requires embeddings to be bf16 or fp16 (got {e.dtype})")
    out = []
    with torch.autocast(e.device.type, enabled=False):
        for lo in range(0, e.shape[0], chunk_rows):
            logits = F.linear(e[lo:lo + chunk_rows].float(), c.float())
            out.append(F.cross_entropy(logits, targets[lo:lo + chunk_rows], ignore_index=IGNORE_INDEX,
                                       reduction="none"))
    return torch.cat(out) if out else e.new_zeros(0, dtype=torch.float32)


def token_losses(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, impl: str) -> torch.Tensor:
    """Per-token next-token loss [B, T-1] (fp32) from final hidden states [B, T, D] and lm_head weight [V, D]."""
    if impl in SM90:
        return _liger_sm90_token_losses(hidden, weight, labels, ce=SM90[impl])
    e = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    targets = labels[:, 1:].reshape(-1)
    shape = labels[:, 1:].shape
    if impl == "logits":
        logits = F.linear(e, weight)
        out = F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="none")
    elif impl in FUSED_KERNELS:
        out = FUSED_KERNELS[impl](*fused_operands(e, weight), targets.contiguous())
    else:
        raise LossImplError(f"unknown loss implementation {impl!r}")
    return out.float().view(shape)
