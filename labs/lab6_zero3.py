"""Lab 6: ZeRO-3: a unit's gather, release and reduce-scatter, with one-unit prefetch (chapter 8).

Write the five methods of a unit and the engine's prefetch below. UnitLab and ZeRO3Lab are the
library's classes with them left out; their docstrings list the state you can use
(zerolab.labs.zero3). WHEN each is called (the hooks around every unit's forward and backward) is
the library's. The grader trains a small model of 3 blocks (each a unit, plus a root unit) on 2
ranks with prefetch=1, for 3 steps numbered 0, 1 and 2 as its messages number them (step 1 of two
micro-batches), and compares with one process on the global batch. Stuck? The lab's
notebook has hints, folded: open one at a time.

`phase` says why a method is called: "forward" (a unit's forward, or prefetching for it),
"backward" (a unit's backward, or prefetching for it, and the release after it), "step" (every unit
is released before the optimizer step) or "inspect" (engine.gathered_parameters(), reading the
full weights).

    python -m zerolab.labs grade zero3 labs/lab6_zero3.py
"""

import torch

from zerolab.labs.zero3 import UnitLab, ZeRO3Lab, mark_released, storage_alloc, storage_free


class MyUnit(UnitLab):
    def gather(self, phase):
        """Start bringing the unit's full parameters to this rank, and return at once: the unit
        computing now goes on while they travel. Nothing to do if the unit is gathered, or a
        gather of it is under way.

        Must leave: the gather under way, with whatever wait() needs to finish it.

        May use: self.full (kind -> the flat buffer the unit's parameters are views of; its
        memory is freed while the unit is released), self.shard (kind -> this rank's shard),
        self.handles, self.gathered, storage_alloc, self.comm.all_gather(out, in, async_op=..., tag=...)."""
        raise NotImplementedError("gather")

    def wait(self, phase):
        """Return once the unit's parameters can be read, with the seconds spent waiting (0.0
        will do). If nobody started gathering the unit, start.

        Must leave: the unit gathered (self.gathered), no gather of it in flight, and its
        parameters readable.

        May use: self.gather, self.handles, mark_released."""
        raise NotImplementedError("wait")

    def release(self, phase):
        """Free the unit's full parameters: only this rank's shard stays. It may be called on a unit
        that is not gathered, and on one whose gather is still in flight (a prefetch nobody used).

        Must leave: the full buffers' memory freed, the parameters marked released (reading one
        then raises a clear error instead of reading freed memory), the unit not gathered.

        May use: self.wait, self.handles, self.gathered, storage_free, mark_released."""
        raise NotImplementedError("release")

    def reduce_scatter(self):
        """The unit's backward is done: self.grad_full holds its full gradient (flat and padded;
        None if no gradient reached the unit on this rank, which then contributes zeros: a flat
        tensor of padded_numel zeros, in the dtype and on the device of the unit's full buffer,
        self.full["train"]: fp32 on the CPU here). Start the
        reduction that leaves this rank, once it is waited for, with the mean over the ranks of
        its shard of that gradient, and return at once: backward goes on meanwhile.

        Must leave: in self._rs, what finish_reduce needs to finish it.

        May use: self.grad_full, self.buckets["train"] (.padded_numel, .world_size),
        self.comm.reduce_scatter(out, in, async_op=..., tag=...)."""
        raise NotImplementedError("reduce_scatter")

    def finish_reduce(self):
        """Called a unit later (or at the end of backward). Finish the reduction started by
        reduce_scatter.

        Must leave: self.grad_shard holding this rank's shard of the step's gradient: the first
        micro-batch's result since zero_grad, plus each later one's, added in fp32; the full
        gradient dropped (self.grad_full = None) and self._rs cleared.

        May use: self._rs, self.grad_shard."""
        raise NotImplementedError("finish_reduce")


class MyZeRO3(ZeRO3Lab):
    unit_class = MyUnit

    def _prefetch_after(self, order, u, phase):
        """Unit u is about to compute. Start gathering the units needed after it, so that their
        parameters travel while u computes: exactly self.prefetch of them (1 here), no more (each
        unit gathered ahead holds its full parameters until it is used). `order` lists the units in
        the order this phase needs them (forward: the last forward's order; backward: the reverse
        of the order in which their forwards ENDED). In backward, a unit whose backward is already
        done will not be needed again in this step: skip past it, and still gather self.prefetch
        of the units after u that are needed (fewer only if fewer are left). Nothing to do if
        self.prefetch is 0 or u is not in `order`.

        May use: order, self.prefetch, v.gather(phase) (returns at once), v.reduced (True once v's
        backward is done in this step)."""
        raise NotImplementedError("_prefetch_after")
