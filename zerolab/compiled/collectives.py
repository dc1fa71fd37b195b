"""The functions a ZeRO graph calls to communicate, through zerolab's ledger.

A collective is two nodes, as PyTorch's functional collectives are: a start that launches it
and returns a `Pending`, and a `wait` that returns its result. Between them the graph may run
other nodes, which is what prefetch uses. `free` ends a gathered parameter's life the way
eager ZeRO-3 does, by resizing its storage to zero bytes.

Every rank's ledger is set once with `use(ledger)` before the graph runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_LEDGER = []            # this process's ledger (set by use())


def use(ledger) -> None:
    """The ledger that the graph's collectives go through in this process."""
    _LEDGER[:] = [ledger]


def _ledger():
    if not _LEDGER:
        raise RuntimeError("no ledger: call zerolab.compiled.collectives.use(ledger) before running the graph")
    return _LEDGER[0]


@dataclass
class Pending:
    """A collective in flight: its output, the handle to wait on, and what wait() does after."""

    out: torch.Tensor
    handle: object
    divide_by: int = 1          # a reduce-scatter's sum becomes the mean
    input: torch.Tensor | None = None   # held until the collective is done


def all_gather_start(shard: torch.Tensor, world: int) -> Pending:
    """Launch the all-gather of every rank's `shard` into one flat tensor, world times larger."""
    out = torch.empty(shard.numel() * world, dtype=shard.dtype, device=shard.device)
    return Pending(out, _ledger().all_gather(out, shard, async_op=True, tag="gather"))


def reduce_scatter_start(flat: torch.Tensor, world: int) -> Pending:
    """Launch the reduce-scatter of a flat gradient: this rank gets the mean of its 1/world."""
    out = torch.empty(flat.numel() // world, dtype=flat.dtype, device=flat.device)
    handle = _ledger().reduce_scatter(out, flat, async_op=True, tag="reduce")
    return Pending(out, handle, divide_by=world, input=flat)


def wait(pending: Pending) -> torch.Tensor:
    """The collective's result, once it is complete."""
    pending.handle.wait()
    pending.input = None
    if pending.divide_by != 1:
        pending.out.div_(pending.divide_by)   # exact for a world size that is a power of two
    return pending.out


def free(tensor: torch.Tensor) -> None:
    """Release a gathered parameter's memory now (its views become empty too)."""
    tensor.untyped_storage().resize_(0)


COLLECTIVE_STARTS = (all_gather_start, reduce_scatter_start)
