"""AdamW with fp32 master weights for a model whose parameters are bf16.

The GPU model runs in bf16 parameters (the fla and Cut Cross-Entropy kernels take bf16 as is).
A bf16 number cannot take an update smaller than about 2^-9 of itself, and Adam's update is about
lr per element: at warmup learning rates (1e-7..1e-4 against weights of ~0.02) most updates round
away and the model barely moves. Measured on the H200 (bench/RESULTS.md, multi-GPU section):
after 12 steps of the qwen35-2b warmup, plain AdamW on bf16 parameters was at loss 12.32 and
DeepSpeed's bf16 optimizer (fp32 masters) at 11.08, on the same batches.

So the optimizer's param_groups hold fp32 copies of the parameters; step() turns the model's
gradients into fp32 master gradients, runs AdamW on the masters, and copies the masters back into
the bf16 parameters. The model, its kernels and gradient clipping see bf16 as before. The masters
are part of state_dict(), so a resumed run continues from the exact fp32 weights.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class MasterWeightAdamW(torch.optim.AdamW):
    def __init__(self, params: Iterable[torch.nn.Parameter], **adamw_kwargs: Any) -> None:
        self.model_params = [p for p in params if p.requires_grad]
        masters = [torch.nn.Parameter(p.detach().float().clone()) for p in self.model_params]
        super().__init__(masters, **adamw_kwargs)
        self.masters = masters

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        if closure is not None:
            raise ValueError("MasterWeightAdamW does not take a closure")
        for param, master in zip(self.model_params, self.masters, strict=True):
            master.grad = None if param.grad is None else param.grad.float()
        super().step()
        for master in self.masters:
            master.grad = None  # fp32 gradients are rebuilt each step; do not hold 4 bytes/param
        torch._foreach_copy_(self.model_params, self.masters)
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for param in self.model_params:
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["fp32_masters"] = [m.detach() for m in self.masters]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        masters = state.pop("fp32_masters", None)
        super().load_state_dict(state)
        if masters is None:  # a checkpoint from before master weights: start them from the params
            return
        if len(masters) != len(self.masters):
            raise ValueError(f"optimizer state has {len(masters)} master tensors, the model {len(self.masters)}")
        with torch.no_grad():
            for master, saved in zip(self.masters, masters, strict=True):
                master.copy_(saved)
            torch._foreach_copy_(self.model_params, self.masters)


def needs_master_weights(model: torch.nn.Module) -> bool:
    """True when some trainable parameter is in a precision that loses small updates."""
    return any(p.requires_grad and p.dtype in (torch.bfloat16, torch.float16) for p in model.parameters())
