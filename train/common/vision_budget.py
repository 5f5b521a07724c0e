"""A per-step budget of vision tokens and images, so a step's memory is bounded by construction.

Why: the vision tower's activations grow with the step's image patches (on one H200 the
qwen35-2b peak rose 88 -> 124.5 GiB as steps with 7 and 8 images came, 139.8 GiB on the card).
Nothing in the data bounds how many large images a step draws, so without a budget a run of
large images runs out of memory mid-run. The budget is fixed before the first batch, from the
model and the GPU's memory, and the batch builder never exceeds it (:class:`BudgetGate`).

The formula (all sizes in bytes; constants below, named)::

    usable        = PEAK_FRACTION * device_memory
    text_reserve  = params * (WEIGHT_GRAD_BYTES + OPTIMIZER_BYTES / zero_shards)
                    + step_tokens * layers * hidden * TEXT_ACT_BYTES
    per_token     = merge**2 * depth * vision_hidden * VISION_ACT_BYTES   (one merged vision token)
    vision_tokens = (usable - text_reserve) // per_token
    images        = min(MAX_IMAGES_PER_STEP, vision_tokens)

``params`` counts the text model and the tower. ``TEXT_ACT_BYTES`` and ``VISION_ACT_BYTES`` are
the measured peak of a step (activations saved for the backward, logits chunks, fp32 upcasts,
allocator slack) per unit, calibrated on one H200 (qwen35-2b, a 4 x 8192-token stream,
regional compile): the text part of the step peaked at about 83 GiB, and each merged vision
token (4 patches through 27 blocks of width 1152) added about 7.6 MiB. For qwen35-2b on a
139.8 GiB card that gives about 5,700 vision tokens: five of the largest (1024-token) images
the shape accepts, or about nine of the data's average size.

What the gate does with a document whose images would pass the budget: it waits in the data
layer's carry-over buffer for a later step (train.common.packing.CarryPacker); a document whose
images alone exceed the budget is dropped, with a note that names it. Both are counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PEAK_FRACTION = 0.89  # of the device's memory: 125 of an H200's 139.8 GiB; the rest is allocator headroom
WEIGHT_GRAD_BYTES = 4  # bf16 weight + bf16 gradient per parameter, on every rank
OPTIMIZER_BYTES = 12  # fp32 master + AdamW's two moments per parameter (sharded by ZeRO-2)
TEXT_ACT_BYTES = 32  # peak bytes per token, per decoder layer, per hidden unit (calibrated, see above)
VISION_ACT_BYTES = 64  # peak bytes per patch, per tower block, per tower hidden unit (calibrated)
# Images per step: the tower does per-image work on the host (position-embedding interpolation,
# rotary tables, cu_seqlens), so a step of very many small images is slow though small.
MAX_IMAGES_PER_STEP = 64


@dataclass(frozen=True)
class VisionBudget:
    """At most ``tokens`` merged vision tokens (placeholders) and ``images`` images per step."""

    tokens: int
    images: int
    source: str  # how it was derived, for the header

    def header(self) -> str:
        return f"{self.tokens} vision tokens, {self.images} images per step ({self.source})"


def derive_budget(*, vision: Any, params: int, layers: int, hidden: int, step_tokens: int,
                  device_memory: int, zero_shards: int = 1, device_name: str = "device") -> VisionBudget:
    """The budget of the formula in the module docstring.

    ``vision``: the tower's shape (``depth``, ``hidden_size``, ``spatial_merge_size``: a
    transformers vision config or :class:`train.common.shapes.VisionShape`). ``params``: the whole
    model's (text + tower). ``zero_shards``: ranks that share the optimizer state (1 without ZeRO).
    A budget below one token is 0: that model and step do not fit this device with any image.
    """
    merge = int(getattr(vision, "spatial_merge_size", 2))
    usable = PEAK_FRACTION * device_memory
    reserve = (params * (WEIGHT_GRAD_BYTES + OPTIMIZER_BYTES / max(1, zero_shards))
               + step_tokens * layers * hidden * TEXT_ACT_BYTES)
    per_token = merge * merge * int(vision.depth) * int(vision.hidden_size) * VISION_ACT_BYTES
    tokens = max(0, int((usable - reserve) // per_token))
    gib = 1024 ** 3
    source = (f"{PEAK_FRACTION:.2f} x {device_memory / gib:.1f} GiB of {device_name} - "
              f"{reserve / gib:.1f} GiB for the text step, {per_token / 2**20:.2f} MiB per vision token")
    return VisionBudget(tokens, min(MAX_IMAGES_PER_STEP, tokens), source)


def check_fits(budget: VisionBudget, largest_image_tokens: int) -> None:
    """ValueError (one line) when the budget cannot hold even one of the largest images the
    processor emits: every such image would be dropped, and the run would train on text alone
    without saying so in its numbers."""
    if budget.tokens < largest_image_tokens:
        raise ValueError(f"the vision budget ({budget.header()}) cannot hold one of the largest images "
                         f"({largest_image_tokens} vision tokens): this model and step leave too little memory for "
                         "images on this device; lower --batch-rows or --row-len, add --vision-ckpt, or set "
                         "--vision-budget by hand")


def fixed_budget(tokens: int, images: int | None = None) -> VisionBudget:
    """A budget given by hand (``--vision-budget TOKENS``)."""
    if tokens < 1:
        raise ValueError(f"a vision budget must be >= 1 token, got {tokens}")
    return VisionBudget(tokens, min(MAX_IMAGES_PER_STEP, tokens) if images is None else images, "set by hand")


class BudgetGate:
    """The documents of ONE step, admitted while their images fit the budget.

    ``admit(n_images, n_tokens)`` -> ``"ok"`` (counted against the budget), ``"wait"`` (it would
    pass what is left: left out of this step) or ``"drop"`` (it alone exceeds the whole budget).
    A document without images is always ``"ok"``. What is admitted is an upper bound of what the
    step holds: a packer may still cut an admitted document's image away, never add one.
    """

    def __init__(self, budget: VisionBudget) -> None:
        self.budget = budget
        self.tokens = 0
        self.images = 0
        self.waited = 0
        self.dropped = 0

    def admit(self, n_images: int, n_tokens: int) -> str:
        if n_images == 0:
            return "ok"
        if n_images > self.budget.images or n_tokens > self.budget.tokens:
            self.dropped += 1
            return "drop"
        if self.images + n_images > self.budget.images or self.tokens + n_tokens > self.budget.tokens:
            self.waited += 1
            return "wait"
        self.images += n_images
        self.tokens += n_tokens
        return "ok"

    def release(self, n_images: int, n_tokens: int) -> None:
        """Give back what an admitted document counted (it proved malformed, or other than counted)."""
        self.images -= n_images
        self.tokens -= n_tokens
