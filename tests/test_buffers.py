"""Buffers (BatchNorm's running statistics) under every data-parallel engine, against PyTorch DDP.

PyTorch DDP broadcasts rank 0's buffers at the start of every training forward
(broadcast_buffers=True, its default), so each rank's running statistics restart from rank 0's
and then take one step from its own batch; with broadcast_buffers=False each rank's drift
apart. zerolab's engines do the same, by default and on request. In bf16 / fp16 the buffers
stay fp32 and the modules holding them compute in fp32 (as autocast keeps BatchNorm).
"""

from functools import partial

import pytest
import torch

import zerolab as zl

from helpers import BatchNormNet, my_rows

pytestmark = pytest.mark.slow     # launches ranks or processes (make test-fast leaves it out)

STEPS = 3
LR = 0.1
DATA_PARALLEL = [name for name in zl.engines.NAMES if name != "single"]


def pytorch_ddp(broadcast):
    from torch.nn.parallel import DistributedDataParallel
    model = BatchNormNet()
    ddp = DistributedDataParallel(model, broadcast_buffers=broadcast)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = my_rows(step)
        (ddp(x) - y).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def zerolab_engine(name, broadcast, precision="fp32"):
    engine = zl.engines.make(name, BatchNormNet(), partial(torch.optim.SGD, lr=LR),
                             broadcast_buffers=broadcast, precision=precision)
    for step in range(STEPS):
        x, y = my_rows(step)
        engine.backward((engine(x).float() - y).pow(2).mean())
        engine.step()
        engine.zero_grad()
    dtypes = {n: b.dtype for n, b in engine.module.named_buffers()}
    return engine.state_dict(), dtypes


def every_engine():
    out = {"torch": {b: pytorch_ddp(b) for b in (True, False)}}
    for name in DATA_PARALLEL:
        for b in (True, False):
            out[(name, b)] = zerolab_engine(name, b)[0]
        out[(name, "bf16")] = zerolab_engine(name, True, "bf16")
    return out


def test_buffers_follow_pytorch_ddp_with_and_without_broadcast_and_stay_fp32_in_bf16():
    for rank, seen in enumerate(zl.launch(every_engine, 2)):
        on, off = seen["torch"][True], seen["torch"][False]
        if rank == 1:   # the test can tell the two apart: rank 1's statistics differ without broadcast
            assert (on["blocks.0.1.running_mean"] - off["blocks.0.1.running_mean"]).abs().max() > 1e-2
        for name in DATA_PARALLEL:
            for b, ref in ((True, on), (False, off)):
                state = seen[(name, b)]
                for k in ref:
                    # the same arithmetic up to the summation order of the gradient mean
                    assert torch.allclose(state[k].double(), ref[k].double(), rtol=0, atol=1e-6), (name, b, rank, k)
            state, dtypes = seen[(name, "bf16")]
            assert dtypes["blocks.0.1.running_mean"] == torch.float32, (name, dtypes)
            assert dtypes["blocks.0.1.running_var"] == torch.float32, (name, dtypes)
            assert int(state["blocks.0.1.num_batches_tracked"]) == STEPS
            # bf16 forward: inputs to the BatchNorm carry ~3 significant digits
            worst = (state["blocks.0.1.running_mean"] - on["blocks.0.1.running_mean"]).abs().max()
            assert worst < 3e-2, (name, rank, float(worst))


def single_process_bf16():
    engine = zl.SingleProcess(BatchNormNet(), partial(torch.optim.SGD, lr=LR), precision="bf16")
    x = torch.randn(4, 6)
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()
    return {n: b.dtype for n, b in engine.module.named_buffers()}


def test_one_process_keeps_batchnorm_statistics_in_fp32_too():
    dtypes = single_process_bf16()
    assert dtypes["blocks.0.1.running_mean"] == torch.float32


# ------------------------------------------------------------------ evaluation after training


def a_schedule(model, forward, step_fn):
    """Train, evaluate twice, run a no_grad forward in train mode (it updates this rank's running
    statistics), train once more: each rank's eval logits, then its buffers. PyTorch DDP syncs
    buffers at the forward that FOLLOWS a synced training forward: the first eval after training
    sees rank 0's statistics, and neither the forward after an eval nor the one after a no_grad
    forward syncs. The outputs below tell that rule from others."""
    seen = []
    for i, phase in enumerate(("train", "train", "eval", "eval", "train", "no_grad", "train")):
        model.train(phase != "eval")
        x, y = my_rows(i + 7)
        if phase == "train":
            step_fn((forward(x) - y).pow(2).mean())
        else:
            with torch.no_grad():
                out = forward(x)
            if phase == "eval":
                seen.append(out.detach().clone())
    return seen + [b.detach().clone() for b in model.buffers() if b.is_floating_point()]


def eval_after_training(name):
    from torch.nn.parallel import DistributedDataParallel
    model = BatchNormNet()
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)

    def torch_step(loss):
        loss.backward()
        opt.step()
        opt.zero_grad()
    theirs = a_schedule(model, ddp, torch_step)
    engine = zl.engines.make(name, BatchNormNet(), partial(torch.optim.SGD, lr=LR))

    def zl_step(loss):
        loss.backward()
        engine.optimizer.step()
        engine.optimizer.zero_grad()
    mine = a_schedule(engine.module, engine, zl_step)
    return max((a - b).abs().max().item() for a, b in zip(mine, theirs))


def eval_after_training_every_engine():
    return {name: eval_after_training(name) for name in DATA_PARALLEL}


def test_eval_after_training_sees_the_buffers_pytorch_ddp_would_on_every_rank():
    # the same arithmetic as DistributedDataParallel on every rank: only summation order differs
    # (SGD, three steps: ~1e-7). A rank evaluating with its own statistics differs by ~1e-2.
    for rank, seen in enumerate(zl.launch(eval_after_training_every_engine, 2)):
        for name, worst in seen.items():
            assert worst < 1e-5, (name, rank, worst)
