"""One optimizer wrapper for the trainers: DeepSpeed ZeRO-2, DDP, or one plain module.

    stepper = Stepper.create(module, model, lr=..., lr_lambda=..., device=..., dist=..., deepspeed=...)
    loss = compute(stepper.forward, batch)      # the engine, the DDP wrapper, or the module itself
    stepper.backward(loss)
    grad_norm, skipped = stepper.step(loss)
    stepper.save(tmp_dir, is_main) / stepper.load(checkpoint_dir)   # or state_dict / load_state_dict

Plain torch: AdamW (with fp32 master weights when the parameters are bf16, master_weights.py),
gradient clipping, a LambdaLR schedule. A step whose gradient norm (or, on one rank, whose loss)
is not finite is not applied: the gradients are dropped and the caller decides whether the run
goes on (Runtime.check_finite). DeepSpeed applies its update inside engine.step(), so there a
bad step cannot be skipped (skipped=False). The norm under DDP is of the all-reduced gradients,
so every rank takes the same decision.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from train.common.checkpoint import CheckpointError, load_state, only_weights
from train.common.distributed import DistInfo
from train.common.master_weights import MasterWeightAdamW, needs_master_weights


def make_adamw(model: torch.nn.Module, lr: float, weight_decay: float, device: torch.device,
               fused: bool | None = None, master_weights: bool | None = None,
               betas: tuple[float, float] = (0.9, 0.95)) -> torch.optim.Optimizer:
    """AdamW; with fp32 master weights when the parameters are bf16 (train/common/master_weights.py).

    master_weights=None: on when the model has bf16/fp16 parameters. DeepSpeed keeps its own fp32
    masters, so its client optimizer must be a plain AdamW over the model's parameters (False).
    """
    # fused (default on CUDA): one kernel for the whole update instead of a loop over tensors.
    fused = device.type == "cuda" if fused is None else fused
    kwargs = {"lr": lr, "betas": betas, "weight_decay": weight_decay, "fused": fused or None}
    if master_weights is None:
        master_weights = needs_master_weights(model)
    if master_weights:
        return MasterWeightAdamW(model.parameters(), **kwargs)
    return torch.optim.AdamW(model.parameters(), **kwargs)


def zero2_config(micro_batch: int, grad_clip: float, device: torch.device) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": grad_clip,
        "zero_optimization": {"stage": 2, "overlap_comm": device.type == "cuda", "contiguous_gradients": True},
        "bf16": {"enabled": device.type == "cuda"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


class Stepper:
    def __init__(self, module: torch.nn.Module, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: Any, grad_clip: float, engine: Any = None, forward: torch.nn.Module | None = None,
                 single_rank: bool = True) -> None:
        self.module = module  # what computes the loss (may wrap `model`)
        self.model = model  # whose parameters train and whose state_dict is checkpointed
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.grad_clip = grad_clip
        self.engine = engine
        self.forward = forward if forward is not None else (engine if engine is not None else module)
        self.single_rank = single_rank
        self.step_lr: float | None = None  # the lr of the last step() (None before the first)

    @classmethod
    def create(cls, module: torch.nn.Module, model: torch.nn.Module, *, lr: float, weight_decay: float,
               grad_clip: float, lr_lambda: Callable[[int], float], device: torch.device, dist: DistInfo,
               deepspeed: bool = False, deepspeed_config: dict[str, Any] | None = None,
               fused: bool | None = None, master_weights: bool | None = None,
               data_parallel: bool | None = None) -> Stepper:
        """data_parallel: the model is replicated over the ranks (default: when there are several;
        False for a model alone on its rank, e.g. DFlash's drafter)."""
        opt = make_adamw(model, lr, weight_decay, device, fused=fused, master_weights=False if deepspeed else master_weights)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
        single = not (dist.world_size > 1 if data_parallel is None else data_parallel)
        if deepspeed:
            import deepspeed as ds

            engine, opt, _, sched = ds.initialize(model=module, optimizer=opt, lr_scheduler=sched,
                                                  config=deepspeed_config or zero2_config(1, grad_clip, device))
            return cls(module, model, opt, sched, grad_clip, engine=engine, single_rank=single)
        forward = None
        if not single:  # several ranks without DeepSpeed: DDP keeps them in sync
            forward = torch.nn.parallel.DistributedDataParallel(
                module, device_ids=[device.index] if device.type == "cuda" else None)
        return cls(module, model, opt, sched, grad_clip, forward=forward, single_rank=single)

    @property
    def name(self) -> str:
        if self.engine is not None:
            return "deepspeed-zero2"
        return "adamw+fp32-masters" if isinstance(self.optimizer, MasterWeightAdamW) else "adamw"

    @property
    def lr(self) -> float:
        """The lr the NEXT step will use (the scheduler has already stepped past the last one)."""
        return float(self.scheduler.get_last_lr()[0])

    def _group_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def backward(self, loss: torch.Tensor) -> None:
        if self.engine is not None:
            self.engine.backward(loss)
        else:
            loss.backward()

    def step(self, loss: torch.Tensor | None = None) -> tuple[float | None, bool]:
        """Clip and apply the update: (grad norm, skipped). Skipped when the update was not applied.

        One device sync (the finiteness test); the loss is looked at on one rank only, as another
        rank's loss may differ while the all-reduced gradient norm is the same everywhere."""
        # The lr this update uses, read before the scheduler steps (after it, `lr` is the next one's).
        self.step_lr = self._group_lr()
        if self.engine is not None:
            self.engine.step()
            norm = self.engine.get_global_grad_norm()
            return (None if norm is None else float(norm)), False
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        ok = torch.isfinite(norm)
        if self.single_rank and loss is not None:
            ok = ok & torch.isfinite(loss.detach())
        skipped = not bool(ok)
        if not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()  # the schedule follows the step count, applied or not
        return float(norm), skipped

    # --- state

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer and schedule (plain torch; DeepSpeed writes its own files: save())."""
        if self.engine is not None:
            raise TypeError("DeepSpeed's state is sharded per rank: use save()/load()")
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any], where: Path | str) -> None:
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
        except (RuntimeError, ValueError, KeyError) as exc:
            raise _shape_error(where, exc) from None

    def save(self, tmp: Path, is_main: bool) -> None:
        """This rank's files of a checkpoint: DeepSpeed's (every rank) or model.pt + optim.pt (main)."""
        if self.engine is not None:
            self.engine.save_checkpoint(str(tmp), tag="deepspeed")
        elif is_main:
            state = self.state_dict()
            torch.save(state.pop("model"), tmp / "model.pt")
            torch.save(state, tmp / "optim.pt")

    def load(self, path: Path) -> None:
        written_by_ds = (path / "deepspeed").is_dir()
        if written_by_ds != (self.engine is not None):
            was, now = ("DeepSpeed (deepspeed/)", "plain torch") if written_by_ds else ("plain torch", "DeepSpeed")
            raise CheckpointError(f"checkpoint {path} was written by {was}, this run is {now}: resume with "
                                  f"--deepspeed {'on' if written_by_ds else 'off'}, or use a new --out or --restart")
        try:
            if self.engine is not None:
                with only_weights(path / "deepspeed"):
                    self.engine.load_checkpoint(str(path), tag="deepspeed")
                return
            model = load_state(path / "model.pt")
            state = load_state(path / "optim.pt")
        except CheckpointError:
            raise
        except (RuntimeError, ValueError, KeyError) as exc:
            raise _shape_error(path, exc) from None
        self.load_state_dict({"model": model, **state}, path)


def _shape_error(where: Path | str, exc: BaseException) -> CheckpointError:
    """A checkpoint that does not fit the model built: one line, the first mismatch named."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    detail = next((ln for ln in lines if ln.startswith(("size mismatch", "Missing key", "Unexpected key"))),
                  lines[0] if lines else type(exc).__name__)
    return CheckpointError(f"checkpoint {where} does not fit this model ({detail[:200]}); it was written with "
                           "other model arguments: resume with those, or use a new --out or --restart")
