"""Lab 3: bucketed DDP, whose buckets are all-reduced while backward is still running (chapter 5).

Write the four methods of the reducer below. DDPLab is zl.DDP with them left out; its docstring
lists what you can use (zerolab.labs.ddp.DDPLab). The grader trains a small model on 2 ranks for
3 steps, the second of two micro-batches (the first inside no_sync()), and compares with one
process on the global batch.

    python -m zerolab.labs grade ddp labs/lab3_ddp.py
"""

import torch

from zerolab.labs.ddp import DDPLab


class MyDDP(DDPLab):
    def _take(self, p, b, i, k):
        """p's gradient has just been accumulated in p.grad. Put it in its slot of bucket b.

        p is the i-th parameter of bucket b (its slot: self.buckets.buckets[b].grad_view(i), a view
        into the bucket's flat .grad) and the k-th overall. The step's first gradient of p arrives in
        a tensor autograd has just made (zero_grad set p.grad to None) while the slot still holds the
        last step's values: copy it in, and make p.grad the slot itself. A later micro-batch then
        adds its gradient to p.grad, straight into the bucket, and there is nothing left to do."""
        raise NotImplementedError("_take")

    def _on_grad_ready(self, p):
        """Autograd calls this once p's gradient is accumulated; the last layer's parameters come
        first, so bucket 0 fills first. Put the gradient in its bucket (b, i, k = self._slot[id(p)];
        self._take). Inside no_sync() (self._reducing_now is False) that is all. Otherwise count it
        in (self._missing[b]) and start the all-reduce of every bucket that is now full, in bucket
        order: bucket b may start only after buckets 0 .. b-1 have (self._next is the next to start;
        self._launch(b) starts it). Every rank must start the same all-reduces in the same order."""
        raise NotImplementedError("_on_grad_ready")

    def _reduce(self, b):
        """Start bucket b's all-reduce and return its handle. gloo sums, it cannot average: divide
        the bucket's flat gradient by N first, so that the sum over ranks is the mean. Asynchronous
        (async_op=True), so backward goes on while it travels; tag it f"bucket{b}"."""
        raise NotImplementedError("_reduce")

    def _finish_backward(self):
        """Autograd has no work left. Start, in order, every bucket not started yet (a bucket with a
        parameter backward never reached is never full), then wait for every all-reduce still in
        flight (self._wait_oldest() until self._pending is empty): when backward returns, every
        p.grad must be the mean over ranks."""
        raise NotImplementedError("_finish_backward")
