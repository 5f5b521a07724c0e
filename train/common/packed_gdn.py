"""A Qwen3.5 gated-delta-net layer whose conv and recurrence kernels are chosen per model.

Why a subclass rather than transformers' own switch: transformers picks ``causal_conv1d_fn`` and
``chunk_gated_delta_rule`` ONCE, at import of ``modeling_qwen3_5``, into module globals; a failed
``import fla`` is swallowed there, and its torch fallbacks cannot keep packed documents apart.
:func:`train.common.fastpath.install_kernels` instead swaps each GDN layer's class to
:class:`PackedGatedDeltaNet` (same parameters, same state_dict, same math) and sets two instance
attributes, ``conv_impl`` and ``gdr_impl``, to the kernels :func:`select_kernels` chose. So the
kernel choice lives in one place, per model, and is visible (``layer.conv_impl.__name__``).

Packing metadata arrives as the forward kwargs ``cu_seq_lens_q`` (the batch flattened to one
sequence of B*T tokens, see :func:`train.common.packing.collate`) and/or ``seq_idx`` ``[B, T]``;
either one is enough, the other is derived. Without both, every row is one sequence.

Kernel adapter signatures::

    conv_impl(x [B, D, T], weight [D, W], bias, activation, seq_idx [B, T] int32, cu_seqlens) -> [B, D, T]
    gdr_impl(q, k [B, T, H, Dk], v [B, T, HV, Dv], g, beta [B, T, HV], cu_seqlens, use_qk_l2norm_in_kernel)
        -> [B, T, HV, Dv]
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet, apply_mask_to_padding_states

from train.common.reference_kernels import (
    causal_conv1d_varlen,
    chunk_gated_delta_rule_varlen,
    cu_seqlens_to_seq_idx,
    row_cu_seqlens,
    seq_idx_to_cu_seqlens,
)


def packing_metadata(
    batch: int, seq_len: int, device: torch.device, cu_seqlens: torch.Tensor | None, seq_idx: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both ``(cu_seqlens, seq_idx)`` from whichever was given (neither: one sequence per row)."""
    if cu_seqlens is None and seq_idx is None:
        cu_seqlens = row_cu_seqlens(batch, seq_len, device)
    if cu_seqlens is None:
        cu_seqlens = seq_idx_to_cu_seqlens(seq_idx)
    if seq_idx is None:
        seq_idx = cu_seqlens_to_seq_idx(cu_seqlens, batch * seq_len).view(batch, seq_len)
    if seq_idx.dim() == 1:
        seq_idx = seq_idx.view(batch, seq_len)
    return cu_seqlens.to(device=device, dtype=torch.int32), seq_idx.to(device=device, dtype=torch.int32)


# The name transformers' own GDN forward takes its cache by (inspect follows the deprecation wrapper).
_CACHE_KWARG = "cache" if "cache" in inspect.signature(Qwen3_5GatedDeltaNet.forward).parameters else "cache_params"


class PackedGatedDeltaNet(Qwen3_5GatedDeltaNet):
    """Training forward of the GDN layer with per-model kernels that honour document boundaries."""

    conv_impl: Callable[..., torch.Tensor] = staticmethod(causal_conv1d_varlen)
    gdr_impl: Callable[..., torch.Tensor] = staticmethod(chunk_gated_delta_rule_varlen)

    def forward(self, hidden_states, cache=None, attention_mask=None, cache_params=None, **kwargs):
        cache = cache if cache is not None else cache_params  # transformers >= 5.24 says cache, before: cache_params
        if cache is not None:
            # Cached generation is transformers' business; packing is a training-time layout.
            return super().forward(hidden_states, attention_mask=attention_mask, **{_CACHE_KWARG: cache}, **kwargs)
        hidden_states = apply_mask_to_padding_states(hidden_states, attention_mask)
        batch, seq_len, _ = hidden_states.shape
        cu_seqlens, seq_idx = packing_metadata(
            batch, seq_len, hidden_states.device, kwargs.get("cu_seq_lens_q"), kwargs.get("seq_idx")
        )

        mixed_qkv, z, beta, g = self._in_proj(hidden_states)
        mixed_qkv = self.conv_impl(
            mixed_qkv.transpose(1, 2),  # [B, D, T], channel-last in memory
            self.conv1d.weight.squeeze(1),
            self.conv1d.bias,
            activation=self.activation,
            seq_idx=seq_idx,
            cu_seqlens=cu_seqlens,
        ).transpose(1, 2)
        query, key, value = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        query = query.reshape(batch, seq_len, -1, self.head_k_dim)
        key = key.reshape(batch, seq_len, -1, self.head_k_dim)
        value = value.reshape(batch, seq_len, -1, self.head_v_dim)
        core_attn_out = self.gdr_impl(
            query, key, value, g=g, beta=beta, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True
        )
        return self._out(core_attn_out, z)

    # The two halves around the kernels. train.common.regional_compile compiles them per layer
    # (instance attributes of the same name), so their elementwise chains fuse.
    def _in_proj(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Projections and gates: (mixed_qkv [B, T, D], z, beta, g)."""
        batch, seq_len, _ = hidden_states.shape
        mixed_qkv = self.in_proj_qkv(hidden_states)
        z = self.in_proj_z(hidden_states).reshape(batch, seq_len, -1, self.head_v_dim)
        beta = self.in_proj_b(hidden_states).sigmoid()
        a = self.in_proj_a(hidden_states)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # fp32: A may overflow in half
        return mixed_qkv, z, beta, g

    def _out(self, core_attn_out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Gated RMSNorm of the recurrence output, then out_proj."""
        batch, seq_len = z.shape[:2]
        core_attn_out = self.norm(core_attn_out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(core_attn_out.reshape(batch, seq_len, -1))
