"""Lab 5: ZeRO-2: reduce-scatter each bucket during backward, free the full gradient, and
accumulate micro-batches in fp32 (chapter 7).

Write the three methods below. ZeRO2Lab is zl.ZeRO(stage=2) with them left out; its docstring
lists the state you can use (zerolab.labs.zero2.ZeRO2Lab): the pool of communication buffers, the
owned gradient slices. The reducer that calls them launches each bucket the moment it is full, in
order, and waits for it later. The grader trains a small model on 2 ranks: 3 steps in fp32, numbered
0, 1 and 2 as its messages number them (step 1 of two micro-batches), then a bf16 step of two
micro-batches. Stuck? The lab's notebook has hints, folded: open one at a time.

    python -m zerolab.labs grade zero2 labs/lab5_zero2.py
"""

import torch

from zerolab.labs.zero2 import ZeRO2Lab


class MyZeRO2(ZeRO2Lab):
    def _take(self, p, b, i, k):
        """Called for every gradient, as soon as autograd has accumulated it in p.grad; p is the
        i-th parameter of bucket b.

        Must leave: p's gradient in its place in bucket b's communication buffer, and no full
        gradient kept anywhere else: ZeRO-2 keeps only the reduced slices.

        May use: self._buffer(b), self.buckets.buckets[b] (.offsets[i], .sizes[i])."""
        raise NotImplementedError("_take")

    def _reduce(self, b):
        """Bucket b's buffer is complete. Start the reduction that leaves this rank, once it is
        waited for, with the mean over the ranks of its slice of bucket b, and return the
        collective's handle at once: backward goes on meanwhile. The step's first reduction of
        bucket b (since zero_grad) is the slice's value; a later micro-batch's is added to it by
        _complete.

        May use: self._buffer(b), self.buckets.buckets[b].padded_numel, self.world_size,
        self.grad_shards, self._filled, self._out, self.comm.reduce_scatter(out, in, async_op=...,
        tag=...)."""
        raise NotImplementedError("_reduce")

    def _complete(self, b):
        """Bucket b's reduction has finished. Must leave: the step's reading of bucket b's slice
        (self.owned_grads()) being the sum of its micro-batches' results, added in fp32; the slice
        marked filled; the buffer back in the pool for the next bucket; and, once the last bucket is
        done, no buffer kept at all.

        May use: self._out, self.grad_shards, self._acc32, self._filled, self._buffer_of,
        self._free, self._pending, self._next, self._release_pool()."""
        raise NotImplementedError("_complete")
