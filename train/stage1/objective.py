"""The module the optimizer wrapper (DeepSpeed, DDP) sees: model + next-token loss per token.

Wrapping the loss inside the module lets the fused cross-entropy kernels take the final hidden
states and the lm_head weight directly, so the full-vocab logits are never materialised, while
DDP/DeepSpeed still see one forward call per step.
"""

from __future__ import annotations

import torch

from train.common.losses import token_losses


class CausalLMObjective(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, loss_impl: str) -> None:
        super().__init__()
        self.model = model
        self.loss_impl = loss_impl

    def forward(self, labels: torch.Tensor, **model_kwargs: torch.Tensor) -> torch.Tensor:
        """Per-token loss [B, T-1] in fp32 (0 at ignored labels)."""
        hidden = self.model.model(**model_kwargs).last_hidden_state
        return token_losses(hidden, self.model.lm_head.weight, labels, self.loss_impl)
