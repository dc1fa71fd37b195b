"""Lab 4: ZeRO-1: reduce-scatter the gradients, step the owned slice, all-gather the parameters
(chapter 6).

Write the four methods below. ZeRO1Lab is zl.ZeRO(stage=1) with them left out; its docstring lists
the state you can use (zerolab.labs.zero1.ZeRO1Lab). The reducer that calls them (chapter 5's hooks,
the buckets launched in order after backward) and the step are the library's. The grader trains a
small model in fp32 with AdamW on 2 ranks and compares with one process on the global batch.
Stuck? The lab's notebook has hints, folded: open one at a time.

    python -m zerolab.labs grade zero1 labs/lab4_zero1.py
"""

import torch

from zerolab.labs.zero1 import ZeRO1Lab


class MyZeRO1(ZeRO1Lab):
    def _lay_out_masters(self):
        """Called once, while the engine is built (fp32 training): decide what this rank owns and
        what its optimizer updates.

        Must set: self.shards[b], the slice of bucket b's flat buffer this rank owns: rank r owns
        the r-th of N equal, contiguous slices, the part a reduce-scatter of the bucket hands it;
        every parameter a view into its bucket's flat buffer; self.master_shards[b], the tensor the
        optimizer updates for bucket b, whose update must reach the model's own weights in that
        slice; and self.flat_masters and self.masters, the same list as self.master_shards (the
        names the step reads).

        May use: self.buckets.buckets[b] (.data, .numel, .padded_numel), self.buckets.bind_params(),
        self.rank, self.world_size, self._out (a dict for your _reduce and _complete)."""
        raise NotImplementedError("_lay_out_masters")

    def _reduce(self, b):
        """Bucket b's gradient is complete. Start the reduction that leaves this rank, once it is
        waited for, with the mean over the ranks of ITS slice of the bucket's gradient only (not
        the whole bucket); return the collective's handle, and keep what _complete will need.

        May use: self._grad_bucket(b), self._ready_to_reduce(b, flat), self.world_size,
        self.comm.reduce_scatter(out, in, async_op=..., tag=...), self._out."""
        raise NotImplementedError("_reduce")

    def _complete(self, b):
        """Bucket b's reduction has finished. Must leave the mean of this rank's slice where the
        step reads it: this rank's slice of the bucket's gradient,
        self.buckets.buckets[b].grad[self.shards[b]]. (The rest of the buffer may keep anything:
        nothing reads it.)"""
        raise NotImplementedError("_complete")

    def _publish(self):
        """The optimizer has updated this rank's slices. Must leave every rank holding the whole
        updated model: every bucket's flat buffer, every rank's slice of it.

        May use: self.buckets.buckets, self.shards, self.comm.all_gather(out, in, tag=...) (out: one
        flat tensor N times the size of in, every rank's in, in rank order)."""
        raise NotImplementedError("_publish")
