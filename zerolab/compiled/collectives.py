"""The functions a ZeRO graph calls to communicate, through zerolab's ledger.

A collective is two nodes, as PyTorch's functional collectives are: a start that launches it
and returns a `Pending`, and a `wait` that returns its result. Between them the graph may run
other nodes, which is what prefetch uses. `free` ends a gathered parameter's life the way
eager ZeRO-3 does, by resizing its storage to zero bytes.

Every rank's ledger is set once with `use(ledger)` before the graph runs. Give it no timeout
(`zl.comm.Ledger(timeout=None)`): a watched wait asks the work for a future, and that future
keeps a reference to the result after the collective is done, so the memory would be freed
later than the graph says.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

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
    lent: list = field(default_factory=list)   # [(storage, references it had before the backend got it)]


def _lend(tensor: torch.Tensor, lent: list) -> torch.Tensor:
    """A view of `tensor` for the backend, noting how many references its memory had before.

    The backend's thread keeps the view a moment after the collective completes. wait() waits
    for it to let go, so that memory is freed where the graph says, not whenever the thread is
    scheduled: the liveness pass can then predict the peak to the byte.
    """
    storage = tensor.untyped_storage()
    lent.append((storage, torch._C._storage_Use_Count(storage._cdata)))
    return tensor.view(tensor.shape)


def _returned(lent: list, timeout: float = 10.0) -> None:
    """Block until the backend holds no view of the lent memory any more."""
    deadline = time.monotonic() + timeout
    for storage, before in lent:
        while torch._C._storage_Use_Count(storage._cdata) > before and time.monotonic() < deadline:
            time.sleep(0)


def all_gather_start(shard: torch.Tensor, world: int) -> Pending:
    """Launch the all-gather of every rank's `shard` into one flat tensor, world times larger."""
    out = torch.empty(shard.numel() * world, dtype=shard.dtype, device=shard.device)
    lent = []
    handle = _ledger().all_gather(_lend(out, lent), _lend(shard, lent), async_op=True, tag="gather")
    return Pending(out, handle, lent=lent)


def reduce_scatter_start(flat: torch.Tensor, world: int) -> Pending:
    """Launch the reduce-scatter of a flat gradient: this rank gets the mean of its 1/world."""
    out = torch.empty(flat.numel() // world, dtype=flat.dtype, device=flat.device)
    lent = []
    handle = _ledger().reduce_scatter(_lend(out, lent), _lend(flat, lent), async_op=True, tag="reduce")
    return Pending(out, handle, divide_by=world, input=flat, lent=lent)


def wait(pending: Pending) -> torch.Tensor:
    """The collective's result, once it is complete."""
    pending.handle.wait()
    pending.handle = None
    _returned(pending.lent)
    pending.input = pending.lent = None
    if pending.divide_by != 1:
        pending.out.div_(pending.divide_by)   # exact for a world size that is a power of two
    return pending.out


def free(tensor: torch.Tensor) -> None:
    """Release a gathered parameter's memory now (its views become empty too)."""
    tensor.untyped_storage().resize_(0)


COLLECTIVE_STARTS = (all_gather_start, reduce_scatter_start)
