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

import torch
import torch.nn.functional as F

from train.common.packing import IGNORE_INDEX

IMPLS = ("logits", "cce", "liger")
# Order of preference for `auto` on CUDA, fastest measured first.
CUDA_PREFERENCE = ("cce", "liger")


class LossImplError(RuntimeError):
    """The requested loss kernel cannot be used here."""


def _probe(impl: str) -> str | None:
    """None when `impl` imports, else the import error text."""
    module = {"cce": "cut_cross_entropy", "liger": "liger_kernel.transformers.functional"}.get(impl)
    if module is None:
        return None
    try:
        importlib.import_module(module)
    except Exception as exc:  # a broken triton surfaces as any exception type at import
        return f"{type(exc).__name__}: {exc}"
    return None


def select_loss_impl(device: torch.device, requested: str = "auto") -> str:
    """`auto`: a fused kernel on CUDA when one imports, plain logits otherwise (and on CPU)."""
    if requested not in ("auto", *IMPLS):
        raise LossImplError(f"unknown loss implementation {requested!r} (auto, {', '.join(IMPLS)})")
    if requested == "auto":
        if device.type != "cuda":
            return "logits"
        for impl in CUDA_PREFERENCE:
            if _probe(impl) is None:
                return impl
        return "logits"
    if requested != "logits":
        if device.type != "cuda":
            raise LossImplError(f"--loss-impl {requested} needs a CUDA device (its kernels are Triton)")
        err = _probe(requested)
        if err:
            raise LossImplError(f"--loss-impl {requested}: import failed: {err}")
    return requested


def token_losses(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, impl: str) -> torch.Tensor:
    """Per-token next-token loss [B, T-1] (fp32) from final hidden states [B, T, D] and lm_head weight [V, D]."""
    e = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    targets = labels[:, 1:].reshape(-1)
    shape = labels[:, 1:].shape
    if impl == "logits":
        logits = F.linear(e, weight)
        out = F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="none")
    elif impl == "cce":
        from cut_cross_entropy import linear_cross_entropy

        out = linear_cross_entropy(e.contiguous(), weight, targets, ignore_index=IGNORE_INDEX, reduction="none")
    elif impl == "liger":
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        out = liger_fused_linear_cross_entropy(e.contiguous(), weight, targets, ignore_index=IGNORE_INDEX,
                                               reduction="none")
    else:
        raise LossImplError(f"unknown loss implementation {impl!r}")
    return out.float().view(shape)
