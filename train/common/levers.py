"""The stage-1 speed levers, applied to a built model in one place (trainer and bench alike).

Order matters: the varlen kernels first (:func:`train.common.fastpath.install_kernels`, done
by the caller), then the attention kernel, then regional compile (it wraps the layers'
forwards), then activation checkpointing (it wraps whatever forward a layer has by then).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from train.common import regional_compile, varlen_attention


@dataclass(frozen=True)
class Levers:
    compile: str = "auto"  # auto: on CUDA, off on CPU
    attention: str = "auto"  # auto: varlen on CUDA, sdpa on CPU
    act_ckpt: int = 0  # decoder layers with activation checkpointing (0: none)
    compile_vision: str = "auto"  # the tower's blocks too (auto: with compile, when the tower is on varlen)


def apply_levers(model: torch.nn.Module, device: torch.device, levers: Levers, backend: str = "inductor") -> list[str]:
    """Apply ``levers`` to ``model`` (after install_kernels); the log header's lines about them.

    ``backend``: torch.compile's (the CPU tests use ``aot_eager``: the same graphs, no C++ build).
    """
    attention = varlen_attention.select_attention(levers.attention, device)
    varlen_attention.use_attention(model, attention)
    lines = [f"attention: {varlen_attention.describe(attention, device)}"]
    if attention == "varlen" and varlen_attention.use_vision_varlen(model):
        lines.append(varlen_attention.describe_vision(model))
    if regional_compile.compile_enabled(levers.compile, device):
        cache = regional_compile.configure_cache_dir()
        n = regional_compile.apply_regional_compile(model, backend=backend)
        lines.append(f"compile: regional torch.compile ({backend}) of {n} decoder layers, cache {cache or 'default'}")
        if levers.compile_vision != "off":
            blocks = regional_compile.apply_vision_regional_compile(model, backend=backend)
            if blocks:
                lines.append(f"compile: the vision tower's {blocks} blocks around their varlen attention (dynamic shapes)")
    else:
        lines.append("compile: off")
    if levers.act_ckpt:
        chosen = regional_compile.apply_activation_checkpointing(model, levers.act_ckpt)
        lines.append(f"activation checkpointing: {len(chosen)} layers {chosen}")
    return lines
