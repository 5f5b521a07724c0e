"""Varlen-correct reference token mixers for the Qwen3.5 hybrid (CPU, fp32).

A packed row holds several documents. Every token mixer must keep them apart:

* the gated delta rule (GDN recurrence) starts every document from a zero state;
* the depthwise short causal conv never reads taps from the previous document;
* full attention is block-diagonal causal per document. That one is transformers' own doing: given
  ``position_ids`` that restart at 0 and no 2D attention mask, ``create_causal_mask`` derives the
  document index per token (a new document wherever the position does not step by +1) and builds a
  block-diagonal causal mask for sdpa/eager. The oracle test checks it.

transformers' torch fallbacks do neither of the first two (5.23 refuses packed rows outright,
5.17 silently mixes documents), hence these. They are plain torch, run on any device, and are
autograd-differentiable, so they double as the loud ``--allow-slow-path`` GPU fallback.

Conventions (same as fla's and transformers'): ``q, k`` are ``[B, T, H, Dk]``, ``v`` is
``[B, T, HV, Dv]`` with HV a multiple of H (each q/k head serves HV/H consecutive value heads),
``g`` (log decay, <= 0) and ``beta`` are ``[B, T, HV]``. ``cu_seqlens`` describes the batch
flattened to one sequence of ``B*T`` tokens (as :func:`train.common.packing.collate` makes it);
``None`` means each batch row is one sequence. Queries are scaled by ``Dk**-0.5``.

The recurrence per head, with state ``S`` of shape ``[Dk, Dv]`` and ``S = 0`` at a document start::

    S   <- exp(g_t) * S
    u_t  = beta_t * (v_t - S^T k_t)
    S   <- S + k_t u_t^T
    o_t  = S^T q_t
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # x / sqrt(sum x^2 + eps): the form fla and transformers use, so the numbers agree
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def row_cu_seqlens(batch: int, seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``cu_seqlens`` for an unpacked batch: every row one sequence."""
    return torch.arange(0, (batch + 1) * seq_len, seq_len, dtype=torch.int32, device=device)


def cu_seqlens_to_seq_idx(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Flat ``[total]`` segment index per token from ``cu_seqlens``."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    if int(lengths.sum()) != total:
        raise ValueError(f"cu_seqlens covers {int(lengths.sum())} tokens, the input has {total}")
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device, dtype=torch.int32), lengths)


def seq_idx_to_cu_seqlens(seq_idx: torch.Tensor) -> torch.Tensor:
    """``cu_seqlens`` of the flattened batch from a ``[B, T]`` seq_idx (rows always split)."""
    b, t = seq_idx.shape
    new_segment = torch.ones_like(seq_idx, dtype=torch.bool)
    new_segment[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    starts = torch.nonzero(new_segment.reshape(-1)).flatten()
    end = torch.tensor([b * t], device=seq_idx.device)
    return torch.cat([starts, end]).to(torch.int32)


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    seq_idx: torch.Tensor | None = None,
    **_: object,
) -> torch.Tensor:
    """Depthwise causal conv that never crosses a document boundary.

    ``x``: ``[B, D, T]``; ``weight``: ``[D, W]``; ``seq_idx``: ``[B, T]`` (None: one document per
    row). ``out[t] = sum_i weight[:, W-1-i] * x[t-i]``, taking only taps with
    ``seq_idx[t-i] == seq_idx[t]``; the same arithmetic as ``F.conv1d`` with left padding W-1.
    """
    b, d, t = x.shape
    width = weight.shape[-1]
    xf = x.to(weight.dtype)
    out = xf * weight[:, width - 1, None]
    for shift in range(1, min(width, t)):
        tap = F.pad(xf[..., : t - shift], (shift, 0))
        if seq_idx is not None:
            same_doc = torch.zeros(b, t, dtype=torch.bool, device=x.device)
            same_doc[:, shift:] = seq_idx[:, shift:] == seq_idx[:, : t - shift]
            tap = tap * same_doc[:, None, :]
        out = out + tap * weight[:, width - 1 - shift, None]
    if bias is not None:
        out = out + bias[:, None]
    if activation in ("silu", "swish"):
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"unsupported activation {activation!r}")
    return out.to(x.dtype)


def _prepare(q, k, v, g, beta, use_qk_l2norm_in_kernel, scale):
    """Flatten to one sequence, fp32, heads first: q/k/v [H, N, D], g/beta [H, N]."""
    hv = v.shape[2]
    if q.shape[2] != hv:
        q = q.repeat_interleave(hv // q.shape[2], dim=2)
        k = k.repeat_interleave(hv // k.shape[2], dim=2)
    q, k, v = (x.reshape(-1, *x.shape[2:]).transpose(0, 1).float() for x in (q, k, v))
    g, beta = (x.reshape(-1, x.shape[-1]).transpose(0, 1).float() for x in (g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q * (scale if scale is not None else q.shape[-1] ** -0.5)
    return q, k, v, g, beta


def recurrent_gated_delta_rule_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    scale: float | None = None,
    **_: object,
) -> torch.Tensor:
    """Token-by-token gated delta rule with a state reset at every document start (the spec)."""
    b, t, _, dv = v.shape
    out_dtype = q.dtype
    if cu_seqlens is None:
        cu_seqlens = row_cu_seqlens(b, t, q.device)
    q, k, v, g, beta = _prepare(q, k, v, g, beta, use_qk_l2norm_in_kernel, scale)
    starts = set(cu_seqlens[:-1].tolist())
    heads, dk = k.shape[0], k.shape[-1]
    state = q.new_zeros(heads, dk, dv)
    outputs = []
    for i in range(b * t):
        if i in starts:
            state = q.new_zeros(heads, dk, dv)
        state = state * g[:, i].exp()[:, None, None]
        predicted = torch.einsum("hkv,hk->hv", state, k[:, i])
        u = beta[:, i, None] * (v[:, i] - predicted)
        state = state + k[:, i, :, None] * u[:, None, :]
        outputs.append(torch.einsum("hkv,hk->hv", state, q[:, i]))
    out = torch.stack(outputs, dim=1)  # [H, N, Dv]
    return out.transpose(0, 1).reshape(b, t, -1, dv).to(out_dtype)


def chunk_gated_delta_rule_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    scale: float | None = None,
    chunk_size: int = 64,
    **_: object,
) -> torch.Tensor:
    """Chunked gated delta rule, varlen: the same numbers as the recurrent form, ~chunk_size x fewer steps.

    Every document is padded to a multiple of ``chunk_size`` (padding has k=v=beta=g=0 and comes
    after the document, so it changes nothing), all chunks of all documents are laid out in one
    list, and the sequential scan over chunks zeroes the state at every chunk that starts a
    document. Within a chunk, with ``G`` the cumulative log decay and ``S0`` the state entering
    the chunk, the delta-rule updates ``U`` solve the unit lower-triangular system

        (I + A) U = beta*V - beta*exp(G)*K S0,   A[i, j] = beta_i exp(G_i - G_j) k_i.k_j  (j < i)

    and then ``O = exp(G) Q S0 + (Q K^T * exp(G_i - G_j), j <= i) U`` and
    ``S1 = exp(G_last) S0 + (K * exp(G_last - G))^T U``.
    """
    b, t, _, dv = v.shape
    out_dtype = q.dtype
    if cu_seqlens is None:
        cu_seqlens = row_cu_seqlens(b, t, q.device)
    q, k, v, g, beta = _prepare(q, k, v, g, beta, use_qk_l2norm_in_kernel, scale)
    heads, n_tokens, dk = k.shape
    c = chunk_size

    # Gather every document into chunk-aligned slots; index n_tokens is an all-zero padding token.
    bounds = cu_seqlens.tolist()
    slot_src: list[torch.Tensor] = []
    chunk_starts_doc: list[bool] = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        n_chunks = -(-(end - start) // c)
        src = torch.full((n_chunks * c,), n_tokens, dtype=torch.long)
        src[: end - start] = torch.arange(start, end)
        slot_src.append(src)
        chunk_starts_doc += [True] + [False] * (n_chunks - 1)
    src = torch.cat(slot_src).to(q.device)
    n_chunks_total = len(chunk_starts_doc)

    def to_chunks(x: torch.Tensor) -> torch.Tensor:
        padded = torch.cat([x, x.new_zeros(heads, 1, *x.shape[2:])], dim=1)
        return padded[:, src].reshape(heads, n_chunks_total, c, *x.shape[2:])

    qc, kc, vc = to_chunks(q), to_chunks(k), to_chunks(v)
    gc, bc = to_chunks(g[..., None])[..., 0], to_chunks(beta[..., None])[..., 0]

    cum = gc.cumsum(dim=-1)  # [H, C#, c]
    lower_incl = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    log_decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower_incl, float("-inf"))
    decay = log_decay.exp()  # exp(G_i - G_j) for j <= i, else 0
    strictly_lower = decay * (~torch.eye(c, dtype=torch.bool, device=q.device))
    a_matrix = bc[..., :, None] * (kc @ kc.transpose(-1, -2)) * strictly_lower
    system = a_matrix + torch.eye(c, device=q.device)
    u_from_v = torch.linalg.solve_triangular(system, bc[..., None] * vc, upper=False, unitriangular=True)
    w_state = torch.linalg.solve_triangular(
        system, bc[..., None] * cum.exp()[..., None] * kc, upper=False, unitriangular=True
    )
    intra = (qc @ kc.transpose(-1, -2)) * decay
    q_decayed = qc * cum.exp()[..., None]
    k_to_end = kc * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [H, C#, 1, 1]

    state = q.new_zeros(heads, dk, dv)
    out_chunks = []
    for n in range(n_chunks_total):
        if chunk_starts_doc[n]:
            state = q.new_zeros(heads, dk, dv)
        u = u_from_v[:, n] - w_state[:, n] @ state
        out_chunks.append(q_decayed[:, n] @ state + intra[:, n] @ u)
        state = state * chunk_decay[:, n] + k_to_end[:, n].transpose(-1, -2) @ u
    out_slots = torch.stack(out_chunks, dim=1).reshape(heads, n_chunks_total * c, dv)
    real = src < n_tokens
    out = out_slots.new_zeros(heads, n_tokens, dv)
    out = out.index_copy(1, src[real], out_slots[:, real])
    return out.transpose(0, 1).reshape(b, t, -1, dv).to(out_dtype)
