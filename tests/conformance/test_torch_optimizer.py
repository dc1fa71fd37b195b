"""The optimizer's contract on every engine: a plain torch optimizer, exactly.

Each scenario trains the same model (tests/conformance/cases.py: a frozen layer, a tied pair,
odd sizes, a branch skipped on two steps of six) with PyTorch's loop, once in one process on the
global batch with the plain torch optimizer, and once under each zerolab engine at 2 and 4
ranks. The engines hand the optimizer one tensor per parameter (zerolab.engines.param_views),
so what a torch optimizer does parameter by parameter must come out the same: skipping a
parameter without a gradient (its step count too), amsgrad, maximize, Nesterov momentum,
per-group learning rates and weight decay, state made when the optimizer is built (Adagrad),
a closure, a learning-rate scheduler, and FSDP2's order (the optimizer built over
engine.parameters() after wrapping). Scenarios from PyTorch's own tests of its optimizers and
of ZeroRedundancyOptimizer (test_zero_redundancy_optimizer.py: step with a closure, an lr
scheduler, parameters without gradients) and DeepSpeed's tests/unit/v1/zero/ (unused and
frozen parameters, tied weights, uneven shapes).
"""

import pytest
import torch

import zerolab as zl

from cases import (ENGINES, STEPS, TOL, batch, engine_for, loss_of, model, pytorch_loop, takes_branch, weights,
                   worst)

pytestmark = pytest.mark.slow     # launches ranks (make test-fast leaves it out)


def grouped(net, make):
    """nanoGPT's split (decay on matrices) and the branch at three times the learning rate."""
    named = dict(net.named_parameters())
    branch = [p for n, p in named.items() if n.startswith("branch.")]
    decay = [p for n, p in named.items() if p.dim() >= 2 and not n.startswith("branch.")]
    rest = [p for n, p in named.items() if p.dim() < 2 and not n.startswith("branch.")]
    return make([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0},
                 {"params": branch, "lr": 3e-2}])


OPTIMIZERS = {
    "adamw": lambda net: torch.optim.AdamW(net.parameters(), lr=1e-2),
    "adam, amsgrad, maximize": lambda net: torch.optim.Adam(net.parameters(), lr=1e-2, amsgrad=True,
                                                            maximize=True),
    "sgd, nesterov": lambda net: torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, nesterov=True,
                                                 weight_decay=1e-2),
    "rmsprop, centered": lambda net: torch.optim.RMSprop(net.parameters(), lr=1e-3, centered=True),
    "groups": lambda net: grouped(net, lambda gs: torch.optim.AdamW(gs, lr=1e-2)),
    "adagrad (state made when built)": lambda net: torch.optim.Adagrad(net.parameters(), lr=0.1,
                                                                      initial_accumulator_value=0.1),
    # whole-matrix: only where the engine hands it whole parameters (ZeRO refuses it by name)
    "adafactor": lambda net: torch.optim.Adafactor(net.parameters(), lr=1e-2),
}
ONLY = {"adafactor": ("ddp",)}
LOOPS = ("pytorch's loop", "a closure", "a scheduler", "zerolab's loop", "FSDP2's order")


def scheduler_for(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))


def reference(optimizer, loop):
    """One process, the global batch, the plain optimizer."""
    net = model()
    opt = OPTIMIZERS[optimizer](net)
    sched = scheduler_for(opt) if loop == "a scheduler" else None
    for step in range(STEPS):
        def loss(step=step):
            x, y = batch(step)
            return torch.nn.functional.mse_loss(net(x, takes_branch(step)), y)
        if loop == "a closure":
            def again(step=step):
                opt.zero_grad()
                value = loss(step)
                value.backward()
                return value
            opt.step(again)
        else:
            loss().backward()
            opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    return weights(net)


def train(name, optimizer, loop):
    net = model()
    if loop == "FSDP2's order":         # wrap first, then the optimizer over the engine's parameters
        engine = engine_for(name, net)
        opt = OPTIMIZERS[optimizer](engine)
    else:
        opt = OPTIMIZERS[optimizer](net)
        engine = engine_for(name, net, opt)
        assert engine.optimizer is opt
    if loop == "zerolab's loop":
        for step in range(STEPS):
            engine.backward(loss_of(engine, step))
            engine.step()
            engine.zero_grad()
    else:
        pytorch_loop(engine, opt, scheduler=scheduler_for(opt) if loop == "a scheduler" else None,
                     closure=loop == "a closure")
    return weights(engine)


CASES = [(o, "pytorch's loop") for o in OPTIMIZERS] + [("adamw", loop) for loop in LOOPS[1:]] \
    + [("groups", "FSDP2's order")]


def every_case():
    out = {}
    for name in ENGINES:
        for o, loop in CASES:
            if name not in ONLY.get(o, ENGINES):
                continue
            try:
                out[(name, o, loop)] = train(name, o, loop)
            except Exception as e:      # (one case's failure is reported as that case's)
                out[(name, o, loop)] = f"{type(e).__name__}: {e}"
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["N=2", "N=4"])
def seen(request):
    return request.param, zl.launch(every_case, request.param)


@pytest.mark.parametrize("optimizer, loop", CASES, ids=[f"{o} | {loop}" for o, loop in CASES])
def test_every_engine_steps_as_the_plain_optimizer_in_one_process(seen, optimizer, loop):
    n, results = seen
    want = reference(optimizer, loop)
    for name in ONLY.get(optimizer, ENGINES):
        for rank, r in enumerate(results):
            got = r[(name, optimizer, loop)]
            assert isinstance(got, dict), (name, n, rank, got)
            assert worst(got, want) <= TOL, (name, n, rank, worst(got, want))
    moved = worst(want, weights(model()))
    assert moved > 100 * TOL        # (it trained: the comparison can fail)
