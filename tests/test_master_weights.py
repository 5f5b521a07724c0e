"""fp32 master weights for bf16 parameters (train/common/master_weights.py), on CPU.

The oracle is AdamW on an fp32 copy of the same parameters with the same gradients: the bf16
parameters under MasterWeightAdamW must equal that reference rounded to bf16, step after step.
Plain AdamW on the bf16 parameters is shown to lose the small updates (the bug this fixes).
"""

from __future__ import annotations

import io

import torch

from train.common.master_weights import MasterWeightAdamW, needs_master_weights

LR = 1e-4  # a warmup-sized learning rate: updates of ~1e-4 against weights of ~0.5


def _model(seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    lin = torch.nn.Linear(64, 32)
    with torch.no_grad():
        lin.weight.uniform_(0.25, 1.0)
    return lin


def _grads(step: int, like: list[torch.Tensor]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    # bf16-representable, so the bf16 model's gradients carry exactly what the reference gets
    return [torch.randn(p.shape, generator=g).to(torch.bfloat16).float() for p in like]


def _run(opt: torch.optim.Optimizer, params: list[torch.Tensor], steps: range) -> None:
    for step in steps:
        for p, g in zip(params, _grads(step, params), strict=True):
            p.grad = g.to(p.dtype)
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_bf16_params_follow_the_fp32_reference() -> None:
    ref = _model().to(torch.bfloat16).float()  # the reference starts where the bf16 model starts
    ref_params = list(ref.parameters())
    ref_opt = torch.optim.AdamW(ref_params, lr=LR, weight_decay=0.01)
    model = _model().to(torch.bfloat16)
    assert needs_master_weights(model)
    params = list(model.parameters())
    opt = MasterWeightAdamW(params, lr=LR, weight_decay=0.01)
    for step in range(20):
        _run(ref_opt, ref_params, range(step, step + 1))
        _run(opt, params, range(step, step + 1))
        for p, r in zip(params, ref_params, strict=True):
            assert p.dtype == torch.bfloat16 and p.grad is None
            assert torch.equal(p, r.detach().to(torch.bfloat16)), f"step {step}"
    moved = (ref.weight.detach() - _model().to(torch.bfloat16).float().weight.detach()).abs()
    assert moved.min() > 0  # every weight moved in the reference ...
    plain = _model().to(torch.bfloat16)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=0.01)
    _run(plain_opt, list(plain.parameters()), range(20))
    lost = plain.weight.detach() == _model().to(torch.bfloat16).weight.detach()
    assert lost.float().mean() > 0.5  # ... and plain AdamW on bf16 left most of them where they were
    assert not torch.equal(model.weight, _model().to(torch.bfloat16).weight)


def test_state_dict_resumes_the_exact_masters() -> None:
    def fresh() -> tuple[torch.nn.Module, MasterWeightAdamW]:
        m = _model().to(torch.bfloat16)
        return m, MasterWeightAdamW(m.parameters(), lr=LR)

    straight, straight_opt = fresh()
    _run(straight_opt, list(straight.parameters()), range(10))

    first, first_opt = fresh()
    _run(first_opt, list(first.parameters()), range(5))
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": first_opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    resumed, resumed_opt = fresh()
    resumed.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["opt"])
    _run(resumed_opt, list(resumed.parameters()), range(5, 10))
    for a, b in zip(straight_opt.masters, resumed_opt.masters, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_fp32_models_keep_plain_adamw() -> None:
    from train.stage1.train import Stage1Config, make_optimizer

    cfg = Stage1Config()
    assert type(make_optimizer(_model(), cfg, torch.device("cpu"))) is torch.optim.AdamW
    assert isinstance(make_optimizer(_model().to(torch.bfloat16), cfg, torch.device("cpu")), MasterWeightAdamW)
    assert type(make_optimizer(_model().to(torch.bfloat16), cfg, torch.device("cpu"), master_weights=False)) \
        is torch.optim.AdamW
