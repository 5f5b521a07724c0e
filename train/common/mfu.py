"""Model FLOPs utilisation, torchtitan's convention, for the Qwen3.5 hybrid.

Exact convention (printed in the trainer's log header via :func:`convention`)::

    flops_per_token = 6 * N_matmul + 12 * L_full * n_heads * head_dim * seq_len
                      + 18 * L_gdn * H_v * d_k * d_v
    MFU             = tokens_per_s * flops_per_token / (n_gpus * peak_flops)
    useful MFU      = the same with only the useful (non-padding) tokens per second

* ``N_matmul``: weights of every dense matmul the model runs per token: in all layers the
  q/k/v/o projections (Qwen3.5's q_proj is 2x wide: it also yields the output gate), the GDN
  in_proj_qkv/z/a/b and out_proj, the MLP gate/up/down, PLUS the lm_head (hidden x vocab) --
  counted even when it is tied to the embeddings, because the output matmul is still done. Not
  counted: the embedding lookup (no matmul), norms, biases-free scalars (A_log, dt_bias), the
  depthwise short conv (2*W flops per channel, <0.1%).
* ``6``: forward 2 flops per weight (multiply + add), backward 4.
* Attention term: full-attention layers only (GDN layers have no T x T score matrix), for each of
  QK^T and AV 2*n_heads*head_dim*seq_len flops per token forward, x3 for forward + backward ->
  12*L_full*n_heads*head_dim*seq_len. NOT halved for causal masking (torchtitan does not halve),
  and ``seq_len`` is the packed ROW length even though documents attend only within themselves:
  like torchtitan, this is the dense upper bound, so MFU here is comparable across runs. With
  the flat layout (one stream of B*row_len tokens a step) ``seq_len`` stays ``row_len``, the
  longest document the packer lets through, not the stream length: the same FLOPs per token as
  the row layout, so the two layouts compare.
* Gated-delta-rule term: the chunked recurrence of every GDN layer, charged as torchtitan's
  Qwen3.5 model does: 18*H_v*d_k*d_v per GDN layer per token (forward + backward; the state
  update, the output read and the intra-chunk work, fwd 6 flops per state entry, x3). About
  +0.7% of the 2B shape's FLOPs per token. It is real work on the tensor cores, so leaving it
  out understated MFU.
* ``tokens_per_s``: tokens (real + padding) processed per second by all ``n_gpus`` together
  (all-token MFU, torchtitan's figure). Useful-token MFU counts only the tokens of documents:
  the padding of a row is computed but is not training, so it is the figure to improve.
* Peak: dense bf16 tensor-core peak, 989 TFLOP/s for H100/H200 SXM.

Vision tower (the VLM: images through Qwen3.5's ViT), per step, for the step's actual images::

    vision_flops = sum over images i of  n_i * (6 * N_vis + 12 * depth * hidden * s_i)
    N_vis        = C * T_p * P^2 * hidden                          (patch embed, a conv as a matmul)
                 + depth * (4 * hidden^2 + 2 * hidden * inter)      (qkv, proj, fc1, fc2 per block)
                 + hidden^2 * m^2 + hidden * out_hidden             (the patch merger, per patch)
    MFU          = (tokens_per_s * flops_per_token + vision_flops / step_s) / (n_gpus * peak)

* ``n_i`` = t*h*w patches of image i (its ``image_grid_thw``, before the m x m merge) and ``s_i`` =
  h*w the patches one attention span holds: the tower attends within each frame of each image
  (its ``cu_seqlens``), never across images, so the term is per image, not per row. Not halved
  (the tower's attention is not causal anyway).
* ``N_vis`` is per patch: the merger runs once per m^2 patches on m^2-times wider vectors, so its
  weights ((hidden*m^2)^2 + hidden*m^2*out_hidden) divided by m^2. The learned position
  embedding (a gather), norms and biases are not counted, like the text side; the patch embed's
  backward has no input gradient, which the 6 overstates by 2 FLOPs per weight (<0.5% of the
  tower).
* Useful-token MFU adds the same vision FLOPs (images are never padding):
  ``(useful_tokens_per_s * flops_per_token + vision_flops / step_s) / (n_gpus * peak)``.

Note: figures made with a causal-halved attention term and N = all parameters (another common
convention) come out ~5% lower than this convention for the 2B shape at 8192.
"""

from __future__ import annotations

from typing import Any

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}
H100_H200_PEAK = 989e12


def convention() -> str:
    return (
        "MFU (torchtitan): flops/token = 6*N_matmul (incl. lm_head) + 12*L_full*heads*head_dim*row_len "
        "(not causal-halved) + 18*L_gdn*H_v*d_k*d_v; vision tower per step: sum over images of "
        "patches*(6*N_vis + 12*depth*hidden*patches_per_frame); peak bf16 989 TFLOP/s (H100/H200); "
        "mfu counts all tokens, mfu_useful only non-padding ones"
    )


def _get(config: Any, name: str) -> Any:
    return config[name] if isinstance(config, dict) else getattr(config, name)


def matmul_params(config: Any) -> int:
    """``N_matmul`` for a qwen3_5 text config (a ``Qwen3_5TextConfig`` or a dict of its fields)."""
    h = _get(config, "hidden_size")
    layer_types = list(_get(config, "layer_types"))
    n_gdn = layer_types.count("linear_attention")
    n_full = layer_types.count("full_attention")
    if n_gdn + n_full != len(layer_types):
        raise ValueError(f"unknown layer types in {sorted(set(layer_types))}")

    k_dim = _get(config, "linear_num_key_heads") * _get(config, "linear_key_head_dim")
    v_dim = _get(config, "linear_num_value_heads") * _get(config, "linear_value_head_dim")
    v_heads = _get(config, "linear_num_value_heads")
    gdn = h * (2 * k_dim + v_dim) + h * v_dim + 2 * h * v_heads + v_dim * h  # qkv, z, a+b, out

    heads, kv_heads, head_dim = (_get(config, n) for n in ("num_attention_heads", "num_key_value_heads", "head_dim"))
    full = h * heads * head_dim * 2 + 2 * h * kv_heads * head_dim + heads * head_dim * h  # q(+gate), k, v, o

    mlp = 3 * h * _get(config, "intermediate_size")
    lm_head = h * _get(config, "vocab_size")
    return n_gdn * (gdn + mlp) + n_full * (full + mlp) + lm_head


def gated_delta_rule_flops(config: Any) -> int:
    """torchtitan's per-token charge for the GDN recurrence of all GDN layers (fwd + bwd)."""
    n_gdn = list(_get(config, "layer_types")).count("linear_attention")
    h_v = _get(config, "linear_num_value_heads")
    return 18 * n_gdn * h_v * _get(config, "linear_key_head_dim") * _get(config, "linear_value_head_dim")


def flops_per_token(config: Any, seq_len: int) -> float:
    """Model FLOPs per token (fwd + bwd); ``seq_len`` is the row length (the longest document)."""
    layer_types = list(_get(config, "layer_types"))
    n_full = layer_types.count("full_attention")
    attention = 12 * n_full * _get(config, "num_attention_heads") * _get(config, "head_dim") * seq_len
    return float(6 * matmul_params(config) + attention + gated_delta_rule_flops(config))


def vision_matmul_params(vision_config: Any) -> int:
    """``N_vis``: tower matmul weights per image patch (a ``Qwen3_5VisionConfig`` or a dict)."""
    h, inter = _get(vision_config, "hidden_size"), _get(vision_config, "intermediate_size")
    m = _get(vision_config, "spatial_merge_size")
    patch = _get(vision_config, "in_channels") * _get(vision_config, "temporal_patch_size") * _get(vision_config, "patch_size") ** 2
    blocks = _get(vision_config, "depth") * (4 * h * h + 2 * h * inter)
    merger = h * h * m * m + h * _get(vision_config, "out_hidden_size")
    return patch * h + blocks + merger


def vision_flops(vision_config: Any, grid_thw: Any) -> float:
    """The tower's FLOPs (fwd + bwd) for a step's images, ``grid_thw`` [n_images, 3] (t, h, w)."""
    if grid_thw is None:
        return 0.0
    per_patch = 6 * vision_matmul_params(vision_config)
    attention = 12 * _get(vision_config, "depth") * _get(vision_config, "hidden_size")
    total = 0
    for t, h, w in (tuple(int(x) for x in g) for g in grid_thw):
        total += t * h * w * (per_patch + attention * h * w)
    return float(total)


def mfu(tokens_per_s: float, flops_per_token: float, n_gpus: int = 1, peak: float = H100_H200_PEAK) -> float:
    """Fraction (0..1) of ``n_gpus * peak`` achieved; ``tokens_per_s`` is the all-GPU total."""
    if n_gpus < 1 or peak <= 0:
        raise ValueError(f"need n_gpus >= 1 and peak > 0, got {n_gpus}, {peak}")
    return tokens_per_s * flops_per_token / (n_gpus * peak)


def mfu_pair(tokens_per_s: float, useful_tokens_per_s: float, flops_per_token: float, n_gpus: int = 1,
             peak: float = H100_H200_PEAK) -> tuple[float, float]:
    """(all-token MFU, useful-token MFU): padding counted, and left out."""
    return mfu(tokens_per_s, flops_per_token, n_gpus, peak), mfu(useful_tokens_per_s, flops_per_token, n_gpus, peak)


def peak_flops(device_name: str) -> float | None:
    """bf16 dense peak for a ``torch.cuda.get_device_name()`` string, or None when unknown."""
    for key, value in PEAK_BF16_FLOPS.items():
        if key in device_name:
            return value
    return None


# ---------------------------------------------------------------------------------------------
# DFlash: the frozen target's forward (extraction) and the drafter's training step.


def extraction_flops_per_token(config: Any, seq_len: int) -> float:
    """Forward-only FLOPs per token of the target's decoder stack, as extraction runs it: the
    convention above divided by 3 (forward only: 2 flops per weight, 4*L_full*h*d*row_len for
    attention, 6*L_gdn*H_v*d_k*d_v for the recurrence), WITHOUT the lm_head (never called)."""
    layer_types = list(_get(config, "layer_types"))
    n_full = layer_types.count("full_attention")
    no_head = matmul_params(config) - _get(config, "hidden_size") * _get(config, "vocab_size")
    attention = 4 * n_full * _get(config, "num_attention_heads") * _get(config, "head_dim") * seq_len
    return float(2 * no_head + attention + gated_delta_rule_flops(config) / 3)


def drafter_step_flops(cfg: Any, vocab: int, ctx_tokens: int, block_tokens: int, key_count: int,
                       head_rows: int) -> dict[str, float]:
    """FLOPs of one DFlash drafter training step (forward + backward), by part.

    ``cfg`` is a DrafterConfig. ``ctx_tokens``: real context tokens (the sum of row lengths);
    ``block_tokens``: block slots of real anchors (anchors x K); ``key_count``: the sum over those
    slots of the keys each really attends (its anchor's context prefix min(a, len) plus the K slots
    of its block); ``head_rows``: slots with a label (the rows through the frozen lm_head).
      - layers, 6N: per block slot the q/k/v/o projections and the SwiGLU MLP of every layer; per
        context token `fc` and every layer's k/v projections (trained: they get gradients);
      - attention: 12 * heads * head_dim per (query, key) pair per layer (QK^T and AV, fwd + bwd),
        by the real key counts, not a dense T x T bound;
      - frozen head, 4N: lm_head forward and the gradient to its input (its weight is frozen).
    Not counted: the no-grad argmax for the accuracy statistics, recomputation of checkpointed chunks.
    """
    h, hq, hkv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    per_slot = cfg.num_layers * (h * hq * d * 2 + 2 * h * hkv * d + 3 * h * cfg.intermediate_size)
    per_ctx = cfg.n_target_layers * h * h + cfg.num_layers * 2 * h * hkv * d
    parts = {"layers": 6.0 * (per_slot * block_tokens + per_ctx * ctx_tokens),
             "attention": 12.0 * cfg.num_layers * hq * d * key_count,
             "head": 4.0 * h * vocab * head_rows}
    parts["total"] = sum(parts.values())
    return parts
