"""zl.engines.make: every name builds the engine it says, with the options it is given."""

from functools import partial

import pytest
import torch

import zerolab as zl
from zerolab.ddp import DDP, NaiveDDP
from zerolab.single import SingleProcess
from zerolab.zero import ZeRO
from zerolab.zero3 import ZeRO3

OPT = partial(torch.optim.AdamW, lr=1e-3)
EXPECTED = {"single": (SingleProcess, None), "naive": (NaiveDDP, None), "ddp": (DDP, None),
            "zero1": (ZeRO, 1), "zero2": (ZeRO, 2), "zero3": (ZeRO3, None)}


def build_every_engine():
    out = {}
    for name in zl.engines.NAMES:
        torch.manual_seed(0)
        options = {} if name in ("single", "naive") else {"bucket_mb": 0.01}
        engine = zl.engines.make(name, torch.nn.Linear(4, 3), OPT, precision="bf16", **options)
        out[name] = (type(engine).__name__, getattr(engine, "stage", None), engine.precision.name,
                     getattr(engine, "bucket_mb", None))
    return out


def test_every_name_builds_its_engine():
    assert set(zl.engines.NAMES) == set(EXPECTED)
    built = zl.launch(build_every_engine, 1)[0]
    for name, (cls, stage) in EXPECTED.items():
        kind, got_stage, precision, bucket_mb = built[name]
        assert kind == cls.__name__, name
        assert precision == "bf16", name                       # options reach the constructor
        if stage is not None:
            assert got_stage == stage, name
        if name not in ("single", "naive", "zero3"):
            assert bucket_mb == 0.01, name


def test_an_unknown_name_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="zero2"):
        zl.engines.make("zero4", torch.nn.Linear(2, 2), OPT)


def test_the_command_line_offers_the_same_names():
    assert zl.train.available_strategies() == ["single", "ddp", "zero1", "zero2", "zero3"]
