"""torch.amp.GradScaler, nanoGPT's fp16 path, on the engines: it works, or it is refused by name.

nanoGPT trains fp16 with fp32 weights under autocast and a GradScaler:

    scaler.scale(loss).backward(); scaler.unscale_(optimizer); scaler.step(optimizer); scaler.update()

On an fp32 engine the optimizer's tensors hold their averaged gradients when backward returns
(views of the engine's own, as p.grad holds them under DistributedDataParallel), so the scaler
unscales and checks them and steps as it does one process: the same weights. An engine that
keeps fp32 masters (precision "bf16" or "fp16") does its own casting and, in fp16, its own loss
scaling: a GradScaler there is refused at its first step, naming what to use instead, before
anything is updated.
"""

import pytest
import torch

import zerolab as zl

from cases import ENGINES, STEPS, TOL, batch, engine_for, loss_of, model, takes_branch, weights, worst

pytestmark = pytest.mark.slow     # launches ranks (make test-fast leaves it out)


def scaled_loop(net, opt, loss_at):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    for step in range(STEPS):
        scaler.scale(loss_at(step)).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)


def reference():
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)

    def loss_at(step):
        x, y = batch(step)
        return torch.nn.functional.mse_loss(net(x, takes_branch(step)), y)
    scaled_loop(net, opt, loss_at)
    return weights(net)


def every_engine():
    out = {}
    for name in ENGINES:
        net = model()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        engine = engine_for(name, net, opt)
        scaled_loop(engine, opt, lambda step: loss_of(engine, step))
        out[name] = weights(engine)
        net = model()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        engine = engine_for(name, net, opt, precision="bf16")
        before = weights(engine)
        try:
            scaled_loop(engine, opt, lambda step: loss_of(engine, step))
            out[(name, "bf16")] = "accepted"
        except RuntimeError as e:
            out[(name, "bf16")] = (str(e), worst(weights(engine), before))
    return out


@pytest.fixture(scope="module")
def seen():
    return zl.launch(every_engine, 2)


@pytest.mark.parametrize("name", ENGINES)
def test_a_grad_scaler_on_an_fp32_engine_steps_as_in_one_process(seen, name):
    want = reference()
    for r in seen:
        assert worst(r[name], want) <= TOL, worst(r[name], want)


@pytest.mark.parametrize("name", ENGINES)
def test_a_grad_scaler_on_an_engine_with_fp32_masters_is_refused_before_any_update(seen, name):
    for r in seen:
        message, moved = r[(name, "bf16")]
        assert "GradScaler" in message and "precision='fp16'" in message and "engine.backward" in message
        assert moved == 0.0
