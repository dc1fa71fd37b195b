"""The model, data and training schedule every engine lab trains, and its single-process reference.

LabNet is small enough that a graded run takes a fraction of a second, and shaped to catch what
a sharding engine gets wrong:

* odd sizes (117, 9, 81, 45, 5 elements), so at N = 2 most flat buffers need padding and a
  slice computed from the unpadded size is off;
* three blocks in an nn.Sequential: ZeRO-3's units (the input and output layers are its root);
* five buckets at bucket_mb=BUCKET_MB (one or two parameters each).

Every rank trains on its own rows of the same global batch, with the schedule SCHEDULE: the
number of micro-batches in each step (step 1 accumulates two). `reference` trains ONE process on
the global batch with plain PyTorch and records what an engine must reproduce, plus the wrong
answers students' mistakes produce (this rank's own gradient, N times the mean, ...), so a check
can say which mistake it sees.
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..data import SyntheticRegression

D_IN, WIDTH, D_OUT, DEPTH = 13, 9, 5, 3
ROWS = 3                  # rows per rank per micro-batch
SCHEDULE = (1, 2, 1)      # micro-batches per step: step 1 accumulates two
BUCKET_MB = 0.0004        # about 100 fp32 numbers: one or two parameters per bucket
# eps=1e-6 as in the parity tests: it bounds how much Adam amplifies round-off (tests/tolerances.py)
OPTIMIZER = partial(torch.optim.AdamW, lr=1e-3, eps=1e-6, weight_decay=0.0)


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width, bias=False)    # 81 elements: odd

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class LabNet(nn.Module):
    """13 inputs -> 5 outputs through three residual tanh blocks of width 9."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, WIDTH)
        self.blocks = nn.Sequential(*[Block(WIDTH) for _ in range(DEPTH)])
        self.out = nn.Linear(WIDTH, D_OUT)

    def forward(self, x):
        return self.out(self.blocks(torch.tanh(self.inp(x))))


class LabNetWithSpare(LabNet):
    """LabNet and a layer its forward never calls: parameters no backward reaches, as in a model
    with an unused branch (chapter 5's first pitfall). They sort into bucket 0, which then never
    fills."""

    def __init__(self):
        super().__init__()
        self.spare = nn.Linear(D_IN, 1)


class LabNetWithBranch(LabNet):
    """LabNet with a side block its forward takes only while `branch` is True (the training loop
    sets it): on the steps it is not taken no rank's backward reaches `side`'s parameters, so a
    plain optimizer skips them, step count included (lab 7)."""

    def __init__(self):
        super().__init__()
        self.side = nn.Linear(WIDTH, WIDTH)
        self.branch = True

    def forward(self, x):
        h = self.blocks(torch.tanh(self.inp(x)))
        if self.branch:
            h = h + torch.tanh(self.side(h))
        return self.out(h)


def build() -> LabNet:
    """The same initial weights on every rank and in the reference."""
    torch.manual_seed(0)
    return LabNet()


DATA = SyntheticRegression(d_in=D_IN, d_out=D_OUT)


def micro_batch(step: int, micro: int, rank: int, n: int):
    """Rank `rank`'s rows of micro-batch `micro` of step `step` (n ranks share it)."""
    return DATA.batch(10 * step + micro, ROWS, rank, n)


def global_micro_batch(step: int, micro: int, n: int):
    return DATA.global_batch(10 * step + micro, ROWS * n)


def loss_of(model, batch, micros: int):
    """The mean squared error of a micro-batch, divided by the step's number of micro-batches: the
    gradients of a step's micro-batches then add up to the gradient of the step's mean loss.
    Output and target in one dtype first (an fp16 or bf16 model's output goes to the target's
    fp32): torch 2.11's mse_loss backward fails on mixed dtypes ("Found dtype Float but expected
    Half"), and promoting here computes what later versions do themselves."""
    x, y = batch
    out = model(x)
    dtype = torch.promote_types(out.dtype, y.dtype)
    return F.mse_loss(out.to(dtype), y.to(dtype)) / micros


def train(engine, after_backward=None, after_step=None, backward=None, clock=None) -> None:
    """The PyTorch loop on an engine, SCHEDULE's steps on this rank's rows: all but a step's last
    micro-batch inside no_sync(). after_backward(step) runs after each step's last backward,
    after_step(step) after its optimizer step. backward(loss) replaces loss.backward(). clock (a
    zerolab.labs.overlap.ComputeClock) is told when a forward runs."""
    rank, n = dist.get_rank(), dist.get_world_size()
    for step, micros in enumerate(SCHEDULE):
        for m in range(micros):
            with clock.during("forward") if clock is not None else contextlib.nullcontext():
                loss = loss_of(engine, micro_batch(step, m, rank, n), micros)
            last = m == micros - 1
            with engine.no_sync() if not last else contextlib.nullcontext():
                (backward or torch.Tensor.backward)(loss)
        if after_backward is not None:
            after_backward(step)
        engine.optimizer.step()
        if after_step is not None:
            after_step(step)
        engine.optimizer.zero_grad()


def _grads(model, batches, micros) -> dict:
    """{name: gradient} of the sum of the micro-batches' losses, at the model's current weights."""
    params = dict(model.named_parameters())
    loss = sum(loss_of(model, b, micros) for b in batches)
    return dict(zip(params, (g.detach().clone() for g in torch.autograd.grad(loss, list(params.values())))))


def reference(rank: int, n: int) -> dict:
    """One process on the global batch, step by step, with the answers mistakes give:

    expected[s]   gradient of step s's global batch (what every engine must average to)
    local[s]      this rank's own gradient (its rows only): what a rank holds before the reduction
    last_micro[s] the gradient of step s's last micro-batch only (an accumulation lost)
    weights[s]    the weights after step s; before[s] the weights before it
    """
    model = build()
    opt = OPTIMIZER(model.parameters())
    out = {k: [] for k in ("expected", "local", "last_micro", "weights", "before")}
    for step, micros in enumerate(SCHEDULE):
        out["before"].append({k: v.detach().clone() for k, v in model.named_parameters()})
        every = [global_micro_batch(step, m, n) for m in range(micros)]
        mine = [micro_batch(step, m, rank, n) for m in range(micros)]
        out["expected"].append(_grads(model, every, micros))
        out["local"].append(_grads(model, mine, micros))
        out["last_micro"].append(_grads(model, every[-1:], micros))
        for name, p in model.named_parameters():
            p.grad = out["expected"][-1][name].clone()
        opt.step()
        opt.zero_grad()
        out["weights"].append({k: v.detach().clone() for k, v in model.named_parameters()})
    return out
