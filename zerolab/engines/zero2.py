"""ZeRO stage 2 (P_os+g): ZeRO-1, but each rank keeps only its slice of the gradients too.

    engine = zl.ZeRO(model, partial(torch.optim.AdamW, lr=3e-4), stage=2, precision="bf16")

There is no full gradient buffer. When a parameter's gradient is ready (the post-accumulate-grad
hook of DDP's reducer) it is copied into its bucket's COMMUNICATION buffer and the parameter's
.grad is freed. As soon as a bucket is full it is reduce-scattered asynchronously, during
backward, into the owned gradient slice; its buffer then goes back to a small pool and is
reused by the next bucket. The pool holds a fixed number (N_BUFFERS = 2) of buffers of one
bucket each: the paper's constant buffer C_B, whatever the model's size (it grows only if more
buckets are half-filled at once, and is released after backward).

What this class changes in ZeRO-1:

* _take: the gradient goes to a pool buffer, and p.grad is freed;
* _reduce / _complete: reduce-scatter from the pool buffer into the owned slice, then give the
  buffer back (and, after the last bucket, release the pool);
* no_sync cannot skip communication (there is no full gradient to accumulate into): every
  micro-batch is reduce-scattered and added to the owned slice, so backward() may run several
  times before step(), inside no_sync or not;
* the owned slice is kept in the compute dtype (the paper's 2 Psi / N); when micro-batches
  accumulate it is promoted to fp32 on the second one and every later one is added in fp32.

bitwise=True keeps ZeRO-1's full gradient buckets during backward (ZeRO1._take: a chunk's
gradient waits for the step's fixed tree), so ZeRO-2 saves no gradient memory in that mode.
"""

from __future__ import annotations

import torch

from ..memory import live_bytes
from .zero1 import ZeRO1

N_BUFFERS = 2   # communication buffers of one bucket each (one filling, one in flight)


class ZeRO2(ZeRO1):
    """ZeRO stage 2 on flat padded buckets. Takes ZeRO-1's options."""

    stage = 2
    overlap_default = True            # reduce-scatter each bucket as soon as it is full
    reduces_in_no_sync = True
    accumulates_after_reduce = True   # (Engine.backward) the owned slices add up

    # -------------------------------------------------------------- layout
    def _bind_grad_storage(self):
        n = len(self.buckets.buckets)
        self.grad_shards = [None] * n    # owned gradient slices (compute dtype), from backward to zero_grad
        self._acc32 = [None] * n         # fp32 accumulators, from the second micro-batch on
        self._filled = [False] * n       # owned slice already holds a gradient
        self.buffer_numel = max(b.padded_numel for b in self.buckets.buckets)
        self.max_buffers = 0             # most pool buffers alive at once (measured)
        self.max_buffer_bytes = 0        # most bytes in those buffers at once (C_B, measured)
        self._release_pool()

    # -------------------------------------------------------------- the buffer pool
    def _release_pool(self):
        self._buffer_of = {}     # bucket -> its communication buffer
        self._free = []          # buffers ready for reuse
        self._alive = 0

    def _acquire(self):
        while not self._free:
            if self._alive < N_BUFFERS or not self._pending:
                self._alive += 1
                self.max_buffers = max(self.max_buffers, self._alive)
                buf = torch.zeros(self.buffer_numel, dtype=self.precision.compute_dtype, device=self.device)
                pool = list(self._buffer_of.values()) + self._free + [buf]
                self.max_buffer_bytes = max(self.max_buffer_bytes, live_bytes(pool))
                return buf
            self._wait_oldest()  # its buffer comes back to the pool
        buf = self._free.pop()
        buf.zero_()
        return buf

    def _buffer(self, b):
        if b not in self._buffer_of:
            self._buffer_of[b] = self._acquire()
        return self._buffer_of[b]

    # -------------------------------------------------------------- the reducer's steps
    def _take(self, p, b, i, k):
        bucket = self.buckets.buckets[b]
        o, n = bucket.offsets[i], bucket.sizes[i]
        # add, not copy: a gradient can arrive in parts (a weight shared by two reentrant
        # activation checkpoints); the buffer starts at zero for every backward
        self._buffer(b)[o:o + n].add_(p.grad.reshape(-1))
        p.grad = None            # the full gradient is not kept

    def _reduce(self, b):
        flat = self._buffer(b)[:self.buckets.buckets[b].padded_numel]   # zeros where nothing arrived
        if self.world_size > 1:
            flat.div_(self.world_size)   # the collective's sum is then the mean
        out = torch.empty(flat.numel() // self.world_size, dtype=flat.dtype, device=self.device)
        if self._filled[b]:
            self._out[b] = out   # a later micro-batch: _complete adds it to the owned slice
        else:
            self.grad_shards[b] = out   # straight into the owned slice (the collective fills it)
        return self.comm.reduce_scatter(out, flat, async_op=True, tag=f"bucket{b}")

    def _complete(self, b):
        if b in self._out:       # accumulate the owned slice in fp32
            more = self._out.pop(b)
            if self.grad_shards[b].dtype == torch.float32:
                self.grad_shards[b].add_(more)
            else:
                if self._acc32[b] is None:
                    self._acc32[b] = self.grad_shards[b].float()
                self._acc32[b].add_(more)
        self._filled[b] = True
        self._free.append(self._buffer_of.pop(b))
        if not self._pending and self._next == len(self.buckets.buckets):
            self._release_pool()     # the last bucket is reduced: no buffer is kept between backwards

    def _grad_tensors(self) -> list:
        held = super()._grad_tensors() + list(self._buffer_of.values()) + self._free
        return held + [g for g in self.grad_shards + self._acc32 if g is not None]

    # -------------------------------------------------------------- the step
    def owned_grads(self) -> list:
        return [a if a is not None else g for a, g in zip(self._acc32, self.grad_shards)]

    def _release_grads(self):
        n = len(self.buckets.buckets)
        self.grad_shards, self._acc32, self._filled = [None] * n, [None] * n, [False] * n
        super()._release_grads()
