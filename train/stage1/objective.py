"""The module the optimizer wrapper (DeepSpeed, DDP) sees: model + next-token loss per token.

Wrapping the loss inside the module lets the fused cross-entropy kernels take the final hidden
states and the lm_head weight directly, so the full-vocab logits are never materialised, while
DDP/DeepSpeed still see one forward call per step.

Both model classes keep the base model in ``.model`` and the head in ``.lm_head``; only the
conditional one (vision) takes ``pixel_values``. Its vision tower is run here, on the images
alone: transformers would hand the text rows' varlen kwargs (``cu_seq_lens_q``, ``seq_idx``) on
to the vision attention too, which under flash-attention collides with the vision tower's own
per-image ``cu_seqlens``.
"""

from __future__ import annotations

import torch

from train.common.losses import token_losses


def base_forward(model: torch.nn.Module, **model_kwargs: torch.Tensor) -> torch.Tensor:
    """Final hidden states [B, T, D] of either model class (no lm_head)."""
    pixel_values = model_kwargs.pop("pixel_values", None)
    image_grid_thw = model_kwargs.pop("image_grid_thw", None)
    if pixel_values is not None:
        images = model.model.get_image_features(pixel_values, image_grid_thw, return_dict=True)
        model_kwargs["mm_encoder_outputs"] = {"image": images}
    # use_cache=False whatever the config says (every checkpoint says true): with a cache present
    # transformers builds no per-document mask from position_ids, and sdpa attends across documents.
    hidden = model.model(**model_kwargs, use_cache=False).last_hidden_state
    visual = getattr(model.model, "visual", None)
    if pixel_values is None and visual is not None and torch.is_grad_enabled():
        # A batch without images: every vision parameter still gets a (zero) gradient, so that DDP
        # and ZeRO ranks, some with images and some without, reduce the same set of gradients.
        hidden = hidden + 0.0 * sum(p.sum() for p in visual.parameters())
    return hidden


class ModelInputError(RuntimeError):
    """transformers refused a batch (e.g. "Image features and image tokens do not match"); one line."""


class CausalLMObjective(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, loss_impl: str) -> None:
        super().__init__()
        self.model = model
        self.loss_impl = loss_impl

    def forward(self, labels: torch.Tensor, **model_kwargs: torch.Tensor) -> torch.Tensor:
        """Per-token loss [B, T-1] in fp32 (0 at ignored labels)."""
        try:
            hidden = base_forward(self.model, **model_kwargs)
        except ValueError as exc:  # transformers checks its inputs with ValueErrors
            raise ModelInputError(f"the model refused a batch: {' '.join(str(exc).split())[:400]}") from exc
        return token_losses(hidden, self.model.lm_head.weight, labels, self.loss_impl)
