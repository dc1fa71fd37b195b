"""zl.engines.make: every name builds the engine it says, with the options it is given."""

import time
from functools import partial

import pytest
import torch

import zerolab as zl
from zerolab.engines.ddp import DDP
from zerolab.engines.naive_ddp import NaiveDDP
from zerolab.engines.single import SingleProcess
from zerolab.engines.zero1 import ZeRO1
from zerolab.engines.zero2 import ZeRO2
from zerolab.engines.zero3 import ZeRO3

pytestmark = pytest.mark.slow     # launches ranks or processes (make test-fast leaves it out)

OPT = partial(torch.optim.AdamW, lr=1e-3)
EXPECTED = {"single": (SingleProcess, None), "naive": (NaiveDDP, None), "ddp": (DDP, None),
            "zero1": (ZeRO1, 1), "zero2": (ZeRO2, 2), "zero3": (ZeRO3, 3)}


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


# ------------------------------------------------------------------ one guard per misuse, every engine


def misuse_each_engine():
    import warnings
    out = {}
    for name in zl.engines.NAMES:
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")          # ZeRO-3's note that a Linear is one unit
            engine = zl.engines.make(name, torch.nn.Linear(4, 3), partial(torch.optim.SGD, lr=0.1))
        x = torch.full((2, 4), float(zl.rank() + 1))
        seen = {}
        try:
            engine.step()
        except RuntimeError as e:
            seen["step first"] = str(e)
        engine(x).pow(2).sum().backward()
        try:                        # a second backward before step(): accumulate, or refuse
            engine(x).pow(2).sum().backward()
        except RuntimeError as e:
            seen["backward twice"] = str(e)
        engine.step()
        try:                        # a forgotten zero_grad(): the next backward adds, or is refused
            engine(x).pow(2).sum().backward()
            engine.step()
        except RuntimeError as e:
            seen["no zero_grad"] = str(e)
        engine.zero_grad()
        engine(x).pow(2).sum().backward()           # zero_grad() clears every guard
        engine.step()
        seen["weight"] = engine.state_dict()["weight"]
        out[name] = seen
    return out


def one_process_accumulating(ranks: int = 2):
    """What one process does with the same loop on the global batch (each rank's loss is a sum
    over its rows, so the global loss is their mean): backward twice, step, backward again with
    no zero_grad, step, zero_grad, backward, step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def backward():
        sum(model(torch.full((2, 4), float(r + 1))).pow(2).sum() for r in range(ranks)).div(ranks).backward()
    backward(), backward(), opt.step(), backward(), opt.step(), opt.zero_grad(), backward(), opt.step()
    return model.weight.detach()


def test_every_engine_has_the_same_guards():
    seen = zl.launch(misuse_each_engine, 2)[0]    # rank 0's view
    for name, s in seen.items():
        # step() with no gradient would be a silent no-op (or a step on stale gradients)
        assert "before backward" in s.get("step first", ""), name
        if name == "zero1":
            # a rank holds the averaged gradient of its slice only, beside local gradients of the
            # other slices: a second backward cannot be added, so it is refused, naming both cures
            assert "no_sync" in s.get("backward twice", "") and "zero_grad()" in s["backward twice"], name
            assert "zero_grad()" in s.get("no zero_grad", ""), name
        else:
            # one process, DDP (the reduction divides each backward's gradient by N, so an
            # averaged p.grad plus a new backward averages again) and the engines whose shards add
            # up accumulate a second backward as PyTorch does: the same weights as one process
            assert "backward twice" not in s and "no zero_grad" not in s, name
            reference = one_process_accumulating(1 if name == "single" else 2)   # (single: its own rows)
            torch.testing.assert_close(s["weight"], reference, rtol=1e-6, atol=1e-6, msg=name)


def engines_that_differ(what):
    import torch.distributed as dist
    r = dist.get_rank()
    options = {"stage": dict(name="zero2" if r == 0 else "zero3"),
               "precision": dict(name="zero1", precision="fp32" if r == 0 else "bf16"),
               "bucket_mb": dict(name="ddp", bucket_mb=25.0 if r == 0 else 1.0)}[what]
    name = options.pop("name")
    torch.manual_seed(0)
    try:
        zl.engines.make(name, torch.nn.Sequential(torch.nn.Linear(4, 4)), partial(torch.optim.SGD, lr=0.1),
                        **options)
    except ValueError as e:
        return str(e)
    return "built"


@pytest.mark.parametrize("what, here, there", [("stage", "'ZeRO3'", "'ZeRO2'"),
                                               ("precision", "'bf16'", "'fp32'"),
                                               ("bucket_mb", "1.0", "25.0")])
def test_ranks_whose_engines_differ_stop_before_the_first_collective_naming_both(what, here, there):
    t0 = time.monotonic()
    messages = zl.launch(engines_that_differ, 2, args=(what,))
    assert time.monotonic() - t0 < 60
    assert all("engines' settings differ" in m for m in messages), messages
    assert here in messages[1] and there in messages[1], messages[1]
