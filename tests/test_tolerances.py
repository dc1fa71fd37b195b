"""The premise behind the fp32 parity tolerances (tests/tolerances.py), checked on this CPU's kernels:
round-off in a gradient, amplified by AdamW, changes one update by less than ADAM_ROUNDOFF_STEP on
the models and batches the parity tests use."""

import copy

import pytest
import torch
import torch.nn.functional as F

from tolerances import ADAM_ROUNDOFF_STEP, adam_roundoff_step
from zerolab.data import CharDataset, SyntheticRegression
from zerolab.models import GPT, AwkwardModel, gpt_config


# the parity tests' losses (zerolab.models.gpt_loss / regression_loss), written here in the
# model's own dtype: those helpers compute the loss in fp32, which would put fp32 round-off
# into the fp64 reference
def gpt_loss(model, batch):
    x, y = batch
    logits = model(x)
    return logits, F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def regression_loss(model, batch):
    x, y = batch
    out = model(x)
    return out, F.mse_loss(out, y)


def gradients(model, loss_fn, batch):
    model.zero_grad(set_to_none=True)
    loss_fn(model, batch)[1].backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def fp32_and_fp64_gradients(model, loss_fn, batch):
    exact = copy.deepcopy(model).double()
    wide = tuple(t.double() if t.is_floating_point() else t for t in batch)
    return gradients(model, loss_fn, batch), gradients(exact, loss_fn, wide)


def worst_step(kind):
    torch.manual_seed(0)
    if kind == "gpt":   # the parity tests' models and per-rank batch sizes (2 rows, 3 rows)
        model, data, loss_fn, rows = GPT(gpt_config("nano", bias=False)), CharDataset(32), gpt_loss, 2
    else:
        model, data, loss_fn, rows = AwkwardModel(), SyntheticRegression(d_in=13, d_out=5), regression_loss, 3
    worst = 0.0
    for n in (1, 2, 3, 4):      # the global batches of N = 1..4
        for step in range(3):
            g32, g64 = fp32_and_fp64_gradients(model, loss_fn, data.batch(step, rows * n))
            worst = max(worst, adam_roundoff_step(g32, g64))
    return worst


@pytest.mark.parametrize("kind", ["gpt", "awkward"])
def test_adam_amplified_roundoff_stays_below_the_bound(kind):
    worst = worst_step(kind)
    assert 0 < worst <= ADAM_ROUNDOFF_STEP, worst

