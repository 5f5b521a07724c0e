"""Guards against the silent gradient faults of gated-delta-net training.

Dead decay heads
----------------
A GDN head's decay is ``g = -exp(A_log) * softplus(a + dt_bias)``, and ``dg/dA_log`` carries the
same factor ``exp(A_log)``. A head whose ``exp(A_log)`` is 0 (``A_log = -inf``) or nearly so never
forgets and gets no gradient to leave that state: it is dead for the whole run, and the loss says
nothing. transformers' init draws ``A ~ U(0, 16)`` in the model's dtype; in bf16 some draws round
to 0 and ``log`` gives -inf (transformers#47831); torchtitan raised the lower bound of the draw to
0.01 (torchtitan#4178). Here a random-init model's ``A_log`` is drawn in fp32 from
``log U(A_INIT_LOW, A_INIT_HIGH)`` (:func:`init_decay`), and at start every GDN layer's ``A_log``
and ``dt_bias`` are checked (:func:`check_gdn_heads`): non-finite values, or a head with
``exp(A_log) < DEAD_A_FLOOR`` (the old 1e-6 bound, where torchtitan saw heads effectively frozen),
are named in one line and refused.

Documents per varlen batch
--------------------------
fla < 0.6's GDN state kernels (and its Triton conv) put ``N * HV`` (N: the sequences of the varlen
batch, HV: value heads) on CUDA's grid axis 1, capped at 65,535 blocks: a batch of more than
``65535 // HV`` documents fails to launch (fla#1077; 4,095 documents at 16 heads).
:func:`max_segments` is that bound for a model; the data layer never packs more (the padding
segments counted).
"""

from __future__ import annotations

import math

import torch

from train.common.checkpoint import CheckpointError

A_INIT_LOW = 0.01  # torchtitan's lower bound of the A draw (was 1e-6; transformers': 0)
A_INIT_HIGH = 16.0  # transformers' upper bound
DEAD_A_FLOOR = 1e-6  # exp(A_log) below this: a head that neither decays nor learns to
GRID_AXIS_LIMIT = 65535  # CUDA's cap on grid axes 1 and 2


class DeadHeadError(CheckpointError):
    """A GDN layer's decay parameters would train silently wrong (one line, names the heads)."""


def gdn_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every gated-delta-net layer: the modules holding ``A_log`` and ``dt_bias``."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(getattr(m, "A_log", None), torch.Tensor) and isinstance(getattr(m, "dt_bias", None), torch.Tensor)]


@torch.no_grad()
def init_decay(model: torch.nn.Module, generator: torch.Generator | None = None) -> int:
    """Draw every GDN layer's ``A_log`` as ``log U(A_INIT_LOW, A_INIT_HIGH)`` in fp32 (then cast to
    the parameter's dtype): no head starts dead. Returns the number of layers."""
    layers = gdn_layers(model)
    for _, m in layers:
        a = torch.empty(m.A_log.shape, dtype=torch.float32).uniform_(A_INIT_LOW, A_INIT_HIGH, generator=generator)
        m.A_log.copy_(a.log().to(device=m.A_log.device, dtype=m.A_log.dtype))
    return len(layers)


@torch.no_grad()
def dead_heads(model: torch.nn.Module, floor: float = DEAD_A_FLOOR) -> list[str]:
    """One entry per GDN layer with a bad head: ``"<layer> heads 1, 4 (A_log -inf, dt_bias nan)"``."""
    found = []
    for name, m in gdn_layers(model):
        a_log, dt_bias = m.A_log.detach().float().cpu(), m.dt_bias.detach().float().cpu()
        bad_a = ~torch.isfinite(a_log) | (a_log.exp() < floor)
        bad = (bad_a | ~torch.isfinite(dt_bias)).nonzero().flatten().tolist()
        if bad:
            what = sorted({f"A_log {a_log[h].item():.3g}" for h in bad if bad_a[h]}
                          | {f"dt_bias {dt_bias[h].item():.3g}" for h in bad if not math.isfinite(dt_bias[h].item())})
            found.append(f"{name} head{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))} ({', '.join(what)})")
    return found


def check_gdn_heads(model: torch.nn.Module, source: str, floor: float = DEAD_A_FLOOR) -> int:
    """DeadHeadError (one line) when a GDN head of ``model`` (loaded from ``source``) is dead:
    a non-finite ``A_log``/``dt_bias``, or ``exp(A_log) < floor``. Returns the layers checked."""
    bad = dead_heads(model, floor)
    if bad:
        raise DeadHeadError(f"{source}: dead gated-delta-net head(s), a non-finite A_log/dt_bias or exp(A_log) < "
                            f"{floor:g}, which would train without decay or gradient: {'; '.join(bad)}")
    return len(gdn_layers(model))


def max_segments(model: torch.nn.Module) -> int | None:
    """The most segments (documents and padding) one varlen batch may hold for ``model``'s GDN
    kernels (fla#1077: ``N * HV <= 65535``); None for a model without GDN layers."""
    heads = [int(getattr(m, "num_v_heads", 0) or m.A_log.numel()) for _, m in gdn_layers(model)]
    return GRID_AXIS_LIMIT // max(heads) if heads else None
