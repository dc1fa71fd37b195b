"""zl.debug.first_nonfinite names the module where a NaN or inf was born."""

import torch

from zerolab.runtime import debug
from zerolab.models import GPT, gpt_config


def test_finds_the_module_that_overflowed():
    torch.manual_seed(0)
    model = GPT(gpt_config("nano"))
    with torch.no_grad():
        model.blocks[1].mlp.fc.weight.mul_(1e39)   # the weights overflow to +-inf: inf - inf = nan
    x = torch.randint(0, 96, (2, 8))
    report = debug.first_nonfinite(model, x)
    assert report.module == "blocks.1.mlp.fc"
    assert report.inputs_finite and report.kind == "nan" and report.count == report.numel
    assert "blocks.1.mlp.fc produced" in str(report)


def test_reports_nan_arriving_from_outside_and_clean_runs():
    lin = torch.nn.Sequential(torch.nn.Linear(3, 3))
    assert debug.first_nonfinite(lin, torch.ones(2, 3)) is None
    report = debug.first_nonfinite(lin, torch.tensor([[float("nan"), 1.0, 2.0]]))
    assert report.module == "0" and report.kind == "nan" and not report.inputs_finite
