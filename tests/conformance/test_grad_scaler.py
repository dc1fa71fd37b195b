"""torch.amp.GradScaler, nanoGPT's fp16 path, on the engines: it works, or it is refused by name.

nanoGPT trains fp16 with fp32 weights under autocast and a GradScaler:

    scaler.scale(loss).backward(); scaler.unscale_(optimizer); scaler.step(optimizer); scaler.update()

On zl.DDP in fp32 the optimizer's tensors hold their averaged gradients when backward returns
(views of the engine's own, as p.grad holds them under DistributedDataParallel), whole on every
rank, so every rank's scaler unscales and checks the same numbers and steps (or skips an
overflowed step) as one process does: the same weights, overflows included. On ZeRO each rank
holds only its slice of the gradient, so the ranks' scalers would disagree on a skip: refused at
the first step on every rank, before anything is updated, naming precision='fp16'. An engine that
keeps fp32 masters (precision "bf16" or "fp16") does its own casting and, in fp16, its own loss
scaling: a GradScaler there is refused the same way.
"""

import pytest
import torch

import zerolab as zl

from cases import ENGINES, STEPS, TOL, batch, engine_for, loss_of, model, takes_branch, weights, worst

pytestmark = pytest.mark.slow     # launches ranks (make test-fast leaves it out)


def scaled_loop(net, opt, loss_at, overflow_at):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    skipped = 0
    for step in range(STEPS):
        boost = 1e36 if step == overflow_at else 1.0    # x 2**12: inf, on every rank's half
        scaler.scale(loss_at(step) * boost).backward()
        scaler.unscale_(opt)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped += scaler.get_scale() < before
        opt.zero_grad(set_to_none=True)
    return skipped


# no overflow, or the scaled loss of step 2 overflows fp32 (the scaler skips it and halves)
OVERFLOW_AT = (None, 2)


def reference(overflow_at):
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)

    def loss_at(step):
        x, y = batch(step)
        return torch.nn.functional.mse_loss(net(x, takes_branch(step)), y)
    skipped = scaled_loop(net, opt, loss_at, overflow_at)
    return weights(net), skipped


def every_engine():
    out = {}
    for name in ENGINES:
        for precision, cases in (("fp32", OVERFLOW_AT), ("bf16", OVERFLOW_AT[:1])):
            for overflow_at in cases:
                net = model()
                opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
                engine = engine_for(name, net, opt, precision=precision)
                before = weights(engine)
                try:
                    skipped = scaled_loop(engine, opt, lambda step: loss_of(engine, step), overflow_at)
                    out[(name, precision, overflow_at)] = (weights(engine), skipped)
                except RuntimeError as e:
                    out[(name, precision, overflow_at)] = (str(e), worst(weights(engine), before))
    return out


@pytest.fixture(scope="module")
def seen():
    return zl.launch(every_engine, 2)


@pytest.mark.parametrize("overflow_at", OVERFLOW_AT)
def test_a_grad_scaler_on_ddp_in_fp32_steps_and_skips_as_in_one_process(seen, overflow_at):
    want, want_skipped = reference(overflow_at)
    assert want_skipped == (overflow_at is not None)        # the case overflows once, or never
    for r in seen:
        got, skipped = r[("ddp", "fp32", overflow_at)]
        assert skipped == want_skipped
        assert worst(got, want) <= TOL, worst(got, want)


@pytest.mark.parametrize("name", [e for e in ENGINES if e != "ddp"])
def test_a_grad_scaler_on_zero_is_refused_on_every_rank_before_any_update(seen, name):
    for overflow_at in OVERFLOW_AT:
        for r in seen:
            message, moved = r[(name, "fp32", overflow_at)]
            assert "GradScaler" in message and "slice" in message and "precision='fp16'" in message
            assert moved == 0.0


@pytest.mark.parametrize("name", ENGINES)
def test_a_grad_scaler_on_an_engine_with_fp32_masters_is_refused_before_any_update(seen, name):
    for r in seen:
        message, moved = r[(name, "bf16", None)]
        assert "GradScaler" in message and "precision='fp16'" in message and "engine.backward" in message
        assert moved == 0.0
