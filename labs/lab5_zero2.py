"""Lab 5: ZeRO-2: reduce-scatter each bucket during backward, free the full gradient, and
accumulate micro-batches in fp32 (chapter 7).

Write the three methods below. ZeRO2Lab is zl.ZeRO(stage=2) with them left out; its docstring
lists what you can use (zerolab.labs.zero2.ZeRO2Lab): the pool of communication buffers, the owned
gradient slices. The reducer that calls them launches each bucket the moment it is full, in order.
The grader trains a small model on 2 ranks (fp32, and a bf16 step of two micro-batches).

    python -m zerolab.labs grade zero2 labs/lab5_zero2.py
"""

import torch

from zerolab.labs.zero2 import ZeRO2Lab


class MyZeRO2(ZeRO2Lab):
    def _take(self, p, b, i, k):
        """p's gradient is in p.grad. Copy it, flattened, into its place in bucket b's communication
        buffer (self._buffer(b): at bucket.offsets[i], bucket.sizes[i] elements), then free the full
        gradient (p.grad = None): ZeRO-2 never keeps it."""
        raise NotImplementedError("_take")

    def _reduce(self, b):
        """Bucket b's buffer is full. Divide the bucket's part of it (its first padded_numel elements)
        by N and start its reduce-scatter (async_op=True, tag f"bucket{b}") into a new tensor of
        padded_numel / N elements; return the handle. The first reduction of bucket b since zero_grad
        (self._filled[b] is False) can land straight in self.grad_shards[b]; a later micro-batch's
        must land elsewhere (self._out[b]) for _complete to add it."""
        raise NotImplementedError("_reduce")

    def _complete(self, b):
        """Bucket b's reduce-scatter has finished. A later micro-batch's result is added to the
        bucket's slice in fp32: a bf16 or fp16 slice is promoted once (self._acc32[b] =
        self.grad_shards[b].float()) and every later result added to that. Mark the slice filled, give
        the buffer back to the pool (self._free.append(self._buffer_of.pop(b))), and once the last
        bucket is done (nothing pending, self._next past the last bucket) release the pool."""
        raise NotImplementedError("_complete")
