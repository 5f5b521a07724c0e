"""The trainer's per-token loss against transformers' own loss on the same model and labels."""

from __future__ import annotations

import pytest
import torch

from train.common.losses import LossImplError, select_loss_impl, token_losses
from train.common.packing import IGNORE_INDEX
from train.stage1.model import build_model
from train.stage1.objective import CausalLMObjective


def test_objective_matches_transformers_loss():
    torch.manual_seed(0)
    model, _ = build_model("tiny")
    model.eval()
    ids = torch.randint(0, 4000, (2, 24))
    labels = ids.clone()
    labels[:, :3] = IGNORE_INDEX
    labels[1, 10] = IGNORE_INDEX
    with torch.no_grad():
        expected = model(input_ids=ids, labels=labels).loss
        per_token = CausalLMObjective(model, "logits")(input_ids=ids, labels=labels)
    assert per_token.shape == (2, 23) and per_token.dtype == torch.float32
    valid = labels[:, 1:] != IGNORE_INDEX
    assert torch.all(per_token[~valid] == 0)
    torch.testing.assert_close(per_token.sum() / valid.sum(), expected, atol=1e-5, rtol=1e-5)


def test_loss_impl_selection_on_cpu():
    cpu = torch.device("cpu")
    assert select_loss_impl(cpu, "auto") == "logits"
    with pytest.raises(LossImplError, match="needs a CUDA device"):
        select_loss_impl(cpu, "cce")
    with pytest.raises(LossImplError, match="unknown loss implementation"):
        select_loss_impl(cpu, "fast")
    with pytest.raises(LossImplError):
        token_losses(torch.zeros(1, 2, 4), torch.zeros(8, 4), torch.zeros(1, 2, dtype=torch.long), "bogus")
