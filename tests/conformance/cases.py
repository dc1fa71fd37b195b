"""What the conformance tests share: a model with every awkward part, its data, and a loop.

The model has odd sizes (the flat buffers need padding at N = 2, 3 and 4 and shard edges cut
through parameters), a frozen layer, a weight tied to another, and a branch its forward takes
on some steps only, so on the other steps the branch's parameters have NO gradient and a plain
torch optimizer skips them, step count included. A parameter skipped on two steps of six gets
Adam's bias correction of four steps; one sharing a step count with the others would move by
about lr per step away from it (2.4e-3 at lr 1e-2 over six steps).

Every scenario runs the same loop, PyTorch's own (loss.backward(), optimizer.step(),
optimizer.zero_grad()), in one process on the global batch with the plain torch optimizer
(`reference`) and on each zerolab engine with each rank on its share of the batch
(tests/conformance/test_torch_optimizer.py). The model has no element whose gradient is nearly
zero (every weight feeds a tanh far from saturation on this data), so the ranks' and the one
process's different summation orders change the weights by round-off only: at most 1.0e-7 over
every scenario at 2 and 4 ranks (x86-64, torch 2.13; centered RMSprop, whose sqrt(v - m^2)
amplifies round-off, runs at lr 1e-3 to stay there). TOL = 1e-6 is ten times that, and a
thousandth of what one wrong step count moves.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

import zerolab as zl

STEPS = 6
ROWS = 8                          # the global batch: 8 rows, split over the ranks
TOL = 1e-6
ENGINES = ("ddp", "zero1", "zero2", "zero3")
ZERO3_UNITS = ["embed", "branch", "out"]    # (the rest, tied pair included, in the root unit)


class Branchy(nn.Module):
    """Odd sizes, a frozen layer, a tied pair and a branch taken on some steps only."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(7, 13)
        self.frozen = nn.Linear(13, 13).requires_grad_(False)
        self.branch = nn.Linear(13, 13)
        self.a = nn.Linear(13, 11)
        self.b = nn.Linear(11, 11, bias=False)
        self.c = nn.Linear(11, 11, bias=False)
        self.c.weight = self.b.weight           # tied: one parameter, two uses
        self.out = nn.Linear(11, 5)

    def forward(self, x, take_branch=True):
        h = torch.tanh(self.frozen(torch.tanh(self.embed(x))))
        if take_branch:
            h = h + torch.tanh(self.branch(h))
        h = torch.tanh(self.a(h))
        h = torch.tanh(self.c(torch.tanh(self.b(h))))
        return self.out(h)


def model() -> Branchy:
    torch.manual_seed(0)
    return Branchy()


def batch(step: int):
    """The global batch of `step`: (x, y) of ROWS rows."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(ROWS, 7, generator=g), torch.randn(ROWS, 5, generator=g)


def takes_branch(step: int) -> bool:
    return step % 3 != 1                        # skipped on steps 1 and 4


def my_rows(step: int):
    """This rank's share of the global batch (all of it on one process)."""
    x, y = batch(step)
    if not dist.is_initialized():
        return x, y
    n, r = dist.get_world_size(), dist.get_rank()
    per = ROWS // n
    return x[r * per:(r + 1) * per], y[r * per:(r + 1) * per]


def loss_of(net, step: int, rows=None) -> torch.Tensor:
    x, y = my_rows(step) if rows is None else rows
    return nn.functional.mse_loss(net(x, takes_branch(step)).float(), y)   # (fp16 outputs too)


def pytorch_loop(net, optimizer, steps=range(STEPS), scheduler=None, closure=False):
    """PyTorch's own loop: what the DDP tutorial, nanoGPT and a course's autograder run."""
    for step in steps:
        if closure:
            def again(step=step):
                optimizer.zero_grad()
                loss = loss_of(net, step)
                loss.backward()
                return loss
            optimizer.step(again)
        else:
            loss_of(net, step).backward()
            optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()


def weights(net) -> dict:
    """The trained parameters by name, fp32 on the CPU (an engine's consolidated ones)."""
    sd = net.state_dict() if isinstance(net, nn.Module) else net.full_state_dict()
    return {k: v.detach().float().cpu().clone() for k, v in sd.items()}


def engine_for(name, net, optimizer=None, **options):
    if name == "zero3":
        options.setdefault("units", ZERO3_UNITS)
    return zl.engines.make(name, net, optimizer, **options)


def worst(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)
