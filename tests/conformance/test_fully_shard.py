"""zl.ZeRO beside FSDP2's fully_shard in FSDP2's own order: wrap first, then the optimizer.

FSDP2 users shard the model (fully_shard on each block, then on the root) and only then build
the optimizer, over model.parameters(), which are the shards: the optimizer is never handed to
FSDP2. The same script on zerolab builds zl.ZeRO(model, stage=k) with no optimizer and the
optimizer over engine.parameters() (or, by name, engine.named_parameters()); its first step hands
it to the engine. Both run side by side in the same processes on cases.py's model with PyTorch's
loop and AdamW: the weights (FSDP2's DTensors gathered with full_tensor()) and the optimizer
state (FSDP2's through torch.distributed.checkpoint's get_optimizer_state_dict, keyed by name;
zerolab's through optimizer.state_dict(), keyed by position) must agree. Scenarios from FSDP2's
tests (test/distributed/_composable/fsdp/: the optimizer built after sharding, frozen and unused
parameters, tied weights, uneven shapes).

And FSDP2's fp16 parameters without a GradScaler: precision="fp16", scaler=False computes in fp16
from fp32 masters with no loss scaling, so a bare loss.backward() is a whole backward; it trains
as the one-process engine with the same setting does.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import zerolab as zl

from cases import STEPS, TOL, engine_for, model, pytorch_loop, weights, worst

pytestmark = pytest.mark.slow     # launches ranks (make test-fast leaves it out)

STAGES = (1, 2, 3)


def fsdp2():
    net = model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for name in ("embed", "branch", "out"):
        fully_shard(getattr(net, name), mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    pytorch_loop(net, opt)
    got = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
           for k, v in net.state_dict().items()}
    state = get_optimizer_state_dict(net, opt, options=StateDictOptions(full_state_dict=True))
    return got, state


def zerolab(stage):
    engine = engine_for(f"zero{stage}", model())
    # nanoGPT's rule, by name: decay on matrices (the model's own shapes decide, not the views')
    dims = {n: p.dim() for n, p in engine.module.named_parameters()}
    named = list(engine.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for n, p in named if dims[n] >= 2]},
                             {"params": [p for n, p in named if dims[n] < 2]}], lr=1e-2)
    pytorch_loop(engine, opt)
    assert engine.optimizer is opt
    return weights(engine), opt.state_dict(), [n for n, _ in named if dims[n] >= 2] + \
        [n for n, _ in named if dims[n] < 2]


def fp16_without_scaling(name):
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    engine = engine_for(name, net, opt, precision="fp16", scaler=False)
    pytorch_loop(engine, opt)                   # a bare loss.backward(): accepted
    return weights(engine)


def side_by_side():
    out = {"fsdp2": fsdp2()}
    for stage in STAGES:
        out[stage] = zerolab(stage)
    out["fp16"] = {name: fp16_without_scaling(name) for name in ("ddp", "zero1", "zero2", "zero3")}
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["N=2", "N=4"])
def seen(request):
    return zl.launch(side_by_side, request.param)


@pytest.mark.parametrize("stage", STAGES)
def test_the_optimizer_built_after_wrapping_trains_as_under_fsdp2(seen, stage):
    for r in seen:
        theirs, their_state = r["fsdp2"]
        mine, my_state, order = r[stage]
        assert worst(mine, theirs) <= TOL, worst(mine, theirs)
        # FSDP2 names each parameter's state; zerolab numbers it as a plain optimizer does
        assert len(my_state["state"]) == len(their_state["state"])
        for k, name in enumerate(order):
            if name not in their_state["state"]:
                continue                # (a frozen parameter: no state on either side)
            for key, value in their_state["state"][name].items():
                assert float((my_state["state"][k][key] - value).abs().max()) <= TOL, (name, key)
        assert worst(theirs, weights(model())) > 100 * TOL      # (it trained)


def test_fp16_without_a_loss_scaler_takes_a_bare_backward_and_trains_as_one_process(seen):
    from cases import batch, takes_branch
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    single = zl.SingleProcess(net, opt, precision="fp16", scaler=False)
    for step in range(STEPS):
        x, y = batch(step)
        torch.nn.functional.mse_loss(single(x, takes_branch(step)).float(), y).backward()
        opt.step()
        opt.zero_grad()
    want = weights(single)
    for r in seen:
        for name, got in r["fp16"].items():
            # fp16 forward and backward, summed in other orders: a few fp16 ulps (1e-3 of 1.0)
            # of each gradient, times lr 0.1 over six steps
            assert worst(got, want) <= 2e-3, (name, worst(got, want))
