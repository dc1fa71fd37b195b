"""Lab 3: bucketed DDP, whose buckets are all-reduced while backward is still running (chapter 5).

Write the four methods of the reducer below. DDPLab is zl.DDP with them left out; its docstring
lists the state you can use (zerolab.labs.ddp.DDPLab). The grader trains a small model on 2 ranks for
3 steps, numbered 0, 1 and 2 as its messages number them; step 1 is two micro-batches (the first
inside no_sync()). It compares with one process on the global batch. Stuck? The lab's notebook has hints, folded: open one at a time.

    python -m zerolab.labs grade ddp labs/lab3_ddp.py
"""

import torch

from zerolab.labs.ddp import DDPLab


class MyDDP(DDPLab):
    def _take(self, p, b, i, k):
        """Called for every gradient, as soon as autograd has accumulated it in p.grad; p is the
        i-th parameter of bucket b and the k-th overall.

        Must leave: p's gradient in its slot of bucket b (the part of the bucket's flat gradient
        buffer that belongs to p), and p.grad being that slot, so that what the optimizer reads in
        p.grad is what was all-reduced. A step's first gradient replaces what the slot held at the
        last step; a later micro-batch's adds to it.

        May use: self.buckets.buckets[b].grad_view(i), p's slot."""
        raise NotImplementedError("_take")

    def _on_grad_ready(self, p):
        """Autograd's hook: called once p's gradient is accumulated (the last layer's parameters
        first, so bucket 0 fills first).

        Must: put the gradient in its bucket. Outside no_sync(), start the all-reduce of each bucket
        the moment its last gradient is in, so that it travels while backward computes the layers
        before; every rank must start the same buckets in the same order, bucket 0 first. Inside
        `with engine.no_sync():` gradients only accumulate: start nothing.

        May use: self._slot[id(p)] -> (b, i, k); self._take; self._missing, self._next,
        self._launch(b) and self._reducing_now (DDPLab's docstring says what each holds)."""
        raise NotImplementedError("_on_grad_ready")

    def _reduce(self, b):
        """Called by self._launch(b): start averaging bucket b's flat gradient over the ranks and
        return the collective's handle at once, without waiting: backward goes on computing while
        the bucket travels, and the reducer waits for the handle later. Once it has been waited
        for, the bucket's flat gradient holds the mean over the ranks.

        May use: self.buckets.buckets[b].grad, self.world_size, self.comm (the ledger:
        all_reduce(tensor, op="sum", async_op=False, tag="") returns a handle with .wait() when
        async_op=True, and None after the collective is done otherwise).

        A slot whose parameter this backward did not reach still holds what it held at the last
        step (zero_grad sets p.grad to None and leaves the bucket's numbers as they are). zl.DDP's
        own reducer zeroes such slots before the all-reduce, so that they contribute nothing. You
        need not: in this lab every backward reaches every parameter, except the layer the
        grader's second model never calls, whose slots have never held a gradient (they are
        zeros). Reduce the whole bucket as it is."""
        raise NotImplementedError("_reduce")

    def _finish_backward(self):
        """Called once autograd has no work left. Must: when it returns, every bucket has been
        all-reduced and waited for, so every p.grad is the mean over ranks. A bucket with a
        parameter the backward never reached never fills up: it is reduced all the same, in order.

        May use: self._next, self._launch(b), self._pending, self._wait_oldest()."""
        raise NotImplementedError("_finish_backward")
