"""Lab 6: ZeRO-3: a unit's gather, release and reduce-scatter, with one-unit prefetch (chapter 8).

Write the five methods of a unit and the engine's prefetch below. UnitLab and ZeRO3Lab are the
library's classes with them left out; their docstrings list what you can use
(zerolab.labs.zero3). WHEN each is called (the hooks around every unit's forward and backward) is
the library's. The grader trains a small model of 3 blocks (each a unit, plus a root unit) on 2
ranks with prefetch=1, and compares with one process on the global batch.

    python -m zerolab.labs grade zero3 labs/lab6_zero3.py
"""

import torch

from zerolab.labs.zero3 import UnitLab, ZeRO3Lab, mark_released, storage_alloc, storage_free


class MyUnit(UnitLab):
    def gather(self, phase):
        """Start gathering the unit's full parameters; return at once. Nothing to do if it is
        gathered, or being gathered (self.handles holds its all-gathers in flight). For each kind of
        buffer (kind, full) in self.full.items(): give the buffer its memory back (storage_alloc(full))
        and start an all-gather of this rank's shard, self.shard[kind], into it (async_op=True, tag
        f"gather:{self.name}"), keeping the handle in self.handles[kind]."""
        raise NotImplementedError("gather")

    def wait(self, phase):
        """Return once the unit is gathered, with the seconds spent waiting (0.0 will do). If it is
        gathered already, return at once; if nobody started gathering it, start. Wait for every
        handle, forget them, mark the unit gathered, and let its parameters be read again
        (mark_released(self.params, False))."""
        raise NotImplementedError("wait")

    def release(self, phase):
        """Free the full parameters; only this rank's shard stays. Finish a gather still in flight
        first. If the unit is not gathered there is nothing to free. Otherwise mark its parameters
        released (mark_released(self.params, True): reading one then raises a clear error), free
        the memory of every full buffer (storage_free), and mark the unit not gathered."""
        raise NotImplementedError("release")

    def reduce_scatter(self):
        """The unit's backward is done and self.grad_full holds its full gradient (flat and padded;
        None if no gradient reached the unit on this rank: reduce zeros then). Divide it by N and
        start its reduce-scatter (async_op=True, tag f"reduce:{self.name}") into a new tensor of
        padded_numel / N elements; keep (handle, output) in self._rs."""
        raise NotImplementedError("reduce_scatter")

    def finish_reduce(self):
        """Wait for the reduce-scatter in self._rs. Its output is this rank's gradient shard: keep
        it (self.grad_shard) the first time since zero_grad, add it in fp32 for a later micro-batch.
        Then drop the full gradient (self.grad_full = None) and clear self._rs."""
        raise NotImplementedError("finish_reduce")


class MyZeRO3(ZeRO3Lab):
    unit_class = MyUnit

    def _prefetch_after(self, order, u, phase):
        """Unit u is about to compute. `order` lists the units in the order this phase needs them
        (forward: the last forward's order; backward: the reverse of the order in which their
        forwards ENDED). Start gathering the self.prefetch units that come after u in `order`
        (v.gather(phase) returns at once), skipping in backward the units whose backward is already
        done (v.reduced). Nothing to do if self.prefetch is 0 or u is not in `order`."""
        raise NotImplementedError("_prefetch_after")
