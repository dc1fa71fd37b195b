"""optimizer.state_dict() and load_state_dict() on every engine: PyTorch's format, the whole model.

After six AdamW steps of cases.py's model (a branch skipped on two of them), the engine's
optimizer.state_dict() must be the plain one-process AdamW's: the same parameter groups with
every hyperparameter, one entry per parameter numbered as a plain optimizer numbers them, the
branch's step count 4 and the others' 6, the moments within TOL. Under ZeRO it is a collective
(every rank calls it, every rank gets the whole), as FSDP2's get_optimizer_state_dict is; under
zl.DDP every rank holds the whole state, so rank 0 alone may call it.

And the checkpoint habits that go through it, each continued for three more steps and compared
with the uninterrupted plain run:

* nanoGPT's: rank 0 torch.saves {"model": ..., "optimizer": optimizer.state_dict()}, and the
  resumed run loads the model, builds its optimizer, loads the optimizer's state into it, and
  only then wraps the model (nanoGPT loads before DistributedDataParallel wraps);
* the same, loading into the engine's optimizer after wrapping;
* a plain PyTorch run's checkpoint imported into an engine (one process -> N ranks);
* a state dict saved under ZeRO-1 loaded into ZeRO-3 (stage -> stage), and one saved under
  ZeRO-3 loaded into a plain AdamW in one process (N ranks -> one process: the test itself).
"""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import zerolab as zl

from cases import ENGINES, STEPS, TOL, batch, engine_for, model, pytorch_loop, takes_branch, weights, worst

pytestmark = pytest.mark.slow     # launches ranks (make test-fast leaves it out)

HALF = STEPS // 2


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def plain(steps, start=None):
    """One process on the global batch: (model, optimizer) after `steps` steps, optionally from
    `start` = (model state, optimizer state)."""
    net = model()
    opt = adamw(net.parameters())
    first = 0
    if start is not None:
        net.load_state_dict(start[0])
        opt.load_state_dict(start[1])
        first = HALF
    for step in range(first, steps):
        x, y = batch(step)
        torch.nn.functional.mse_loss(net(x, takes_branch(step)), y).backward()
        opt.step()
        opt.zero_grad()
    return net, opt


def trained(name, steps=STEPS):
    net = model()
    opt = adamw(net.parameters())
    engine = engine_for(name, net, opt)
    pytorch_loop(engine, opt, range(steps))
    return engine, opt


def habits(name, path):
    out = {}
    engine, opt = trained(name)
    out["state_dict"] = opt.state_dict()                # every rank calls it
    if name == "ddp":                                   # local: rank 0 alone may ask for it
        out["rank0_alone"] = opt.state_dict() if dist.get_rank() == 0 else None

    # nanoGPT: rank 0 saves after HALF steps; the resumed run loads before wrapping
    engine, opt = trained(name, HALF)
    checkpoint = {"model": engine.state_dict(), "optimizer": opt.state_dict()}
    if dist.get_rank() == 0:
        torch.save(checkpoint, path)
    dist.barrier()
    saved = torch.load(path, weights_only=True)
    net = model()
    net.load_state_dict(saved["model"])
    opt = adamw(net.parameters())
    opt.load_state_dict(saved["optimizer"])
    engine = engine_for(name, net, opt)
    pytorch_loop(engine, opt, range(HALF, STEPS))
    out["nanogpt"] = weights(engine)

    # ... loading into the engine's optimizer after wrapping
    net = model()
    opt = adamw(net.parameters())
    engine = engine_for(name, net, opt)
    engine.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    pytorch_loop(engine, opt, range(HALF, STEPS))
    out["after wrapping"] = weights(engine)

    # a plain PyTorch run's checkpoint (every rank computes the same one)
    p_net, p_opt = plain(HALF)
    net = model()
    net.load_state_dict(p_net.state_dict())
    opt = adamw(net.parameters())
    engine = engine_for(name, net, opt)
    opt.load_state_dict(p_opt.state_dict())
    pytorch_loop(engine, opt, range(HALF, STEPS))
    out["plain import"] = weights(engine)
    dist.barrier()
    return out


def across_stages(path):
    """ZeRO-1's state dict into ZeRO-3, and ZeRO-3's out to the test (into a plain AdamW)."""
    engine, opt = trained("zero1", HALF)
    saved = {"model": engine.state_dict(), "optimizer": opt.state_dict()}
    net = model()
    opt = adamw(net.parameters())
    engine = engine_for("zero3", net, opt)
    engine.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    pytorch_loop(engine, opt, range(HALF, STEPS))
    out = {"zero1 -> zero3": weights(engine)}
    engine, opt = trained("zero3", HALF)
    out["zero3 -> plain"] = (engine.state_dict(), opt.state_dict())
    return out


def every_habit(path):
    out = {name: habits(name, os.path.join(path, f"{name}.pt")) for name in ENGINES}
    out.update(across_stages(path))
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["N=2", "N=4"])
def seen(request):
    with tempfile.TemporaryDirectory() as tmp:
        return request.param, zl.launch(every_habit, request.param, args=(tmp,))


def same_state_dict(got, want):
    assert got["param_groups"] == want["param_groups"]
    assert sorted(got["state"]) == sorted(want["state"])
    for k, entries in want["state"].items():
        assert sorted(got["state"][k]) == sorted(entries), k
        for key, value in entries.items():
            mine = got["state"][k][key]
            assert mine.shape == value.shape and mine.dtype == value.dtype, (k, key)
            if key == "step":
                assert torch.equal(mine, value), (k, mine, value)
            else:
                assert float((mine - value).abs().max()) <= TOL, (k, key)


@pytest.mark.parametrize("name", ENGINES)
def test_the_state_dict_is_the_plain_optimizers(seen, name):
    n, results = seen
    _, want = plain(STEPS)
    want = want.state_dict()
    steps = {float(st["step"]) for st in want["state"].values()}
    assert steps == {4.0, 6.0}          # (the skipped branch has its own count)
    for r in results:
        same_state_dict(r[name]["state_dict"], want)
    if name == "ddp":
        same_state_dict(results[0][name]["rank0_alone"], want)


@pytest.mark.parametrize("habit", ["nanogpt", "after wrapping", "plain import"])
@pytest.mark.parametrize("name", ENGINES)
def test_a_resumed_run_ends_where_the_uninterrupted_one_does(seen, name, habit):
    n, results = seen
    want = weights(plain(STEPS)[0])
    for r in results:
        assert worst(r[name][habit], want) <= TOL, (name, habit, worst(r[name][habit], want))


def test_a_state_dict_crosses_stages_and_leaves_for_a_plain_optimizer(seen):
    n, results = seen
    want = weights(plain(STEPS)[0])
    for r in results:
        assert worst(r["zero1 -> zero3"], want) <= TOL
    net, opt = plain(STEPS, start=results[0]["zero3 -> plain"])
    assert worst(weights(net), want) <= TOL
