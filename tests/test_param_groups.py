"""Parameter groups (decay / no-decay, per-group learning rates) under every engine.

The factory is called with the model's parameters, so a script's own rule (nanoGPT's
configure_optimizers: weight decay on tensors of 2 or more dimensions) works as written; the
flat engines then give each parameter of each group its own view of what the rank updates
(zerolab.engines.param_views).
The reference is one process running torch's AdamW on the global batch. A group's lr or
weight decay applied to the wrong elements moves them by ~1e-3 per step; two summation orders
of the same gradient differ by a few ulp, which AdamW's normalised step keeps below 1e-6 here.
"""

import pytest
import os
import tempfile

import torch

import zerolab as zl

from helpers import FACTORIES, make_grouped, model_under_test, train_groups

pytestmark = pytest.mark.slow     # launches ranks or processes (make test-fast leaves it out)

STEPS = 3
TOL = 1e-6




def under_every_engine(factory):
    return {name: train_groups(make_grouped(name, factory), STEPS).state_dict() for name in zl.engines.NAMES
            if name != "single"}


def test_parameter_groups_train_as_one_process_does_under_every_engine():
    for factory in FACTORIES:
        ref = train_groups(make_grouped("single", factory), STEPS).state_dict()
        for rank, seen in enumerate(zl.launch(under_every_engine, 2, args=(factory,))):
            for name, state in seen.items():
                worst = max(float((state[k] - ref[k]).abs().max()) for k in ref)
                assert worst < TOL, (factory, name, rank, worst)


def resume_with_groups(path):
    """Save at ZeRO-3, load at ZeRO-1 (per-parameter optimizer state on both sides)."""
    saver = train_groups(make_grouped("zero3", "lr"), 2)
    zl.checkpoint.save(saver, path)
    loader = make_grouped("zero1", "lr")
    zl.checkpoint.load(loader, path)
    return train_groups(loader, 2, first=2).state_dict()


def test_a_checkpoint_with_groups_resumes_on_another_stage_as_an_uninterrupted_run():
    ref = train_groups(make_grouped("single", "lr"), 4).state_dict()
    with tempfile.TemporaryDirectory() as tmp:
        for state in zl.launch(resume_with_groups, 2, args=(os.path.join(tmp, "ckpt"),)):
            worst = max(float((state[k] - ref[k]).abs().max()) for k in ref)
            assert worst < TOL, worst


def refusals():
    out = {}
    for name in zl.engines.NAMES:
        model, other = model_under_test(), model_under_test()
        cases = {"another model": lambda ps: torch.optim.AdamW(other.parameters()),
                 "a parameter left out": lambda ps: torch.optim.AdamW(list(ps)[1:])}
        for case, factory in cases.items():
            try:
                zl.engines.make(name, model, factory)
                out[(name, case)] = "accepted"
            except TypeError as e:
                out[(name, case)] = str(e)
    return out


def test_an_optimizer_the_engine_cannot_honour_is_refused_not_silently_wrong():
    expected = {"another model": "not this model's parameters",
                "a parameter left out": "in none of the optimizer's parameter groups"}
    seen = zl.launch(refusals, 2)[0]
    for name in zl.engines.NAMES:
        for case, phrase in expected.items():
            assert phrase in seen[(name, case)], (name, case, seen[(name, case)])
