"""Lab 5's planted mistakes: ZeRO-2's own seams (ReferenceZeRO2) with one thing wrong, as students
write it. Each must fail the grader with the failure named in `expect`."""

from __future__ import annotations

import torch

from .lab import Mistake
from .zero2 import ReferenceZeRO2


def _accumulate(engine, b, more):
    """What the library's _complete does with a later micro-batch's slice: add it in fp32."""
    if engine.grad_shards[b].dtype == torch.float32:
        engine.grad_shards[b].add_(more)
    else:
        if engine._acc32[b] is None:
            engine._acc32[b] = engine.grad_shards[b].float()
        engine._acc32[b].add_(more)


class KeepsGradient(ReferenceZeRO2):
    def _take(self, p, b, i, k):
        bucket = self.buckets.buckets[b]
        o, n = bucket.offsets[i], bucket.sizes[i]
        self._buffer(b)[o:o + n].copy_(p.grad.reshape(-1))     # (and p.grad is kept)


class GivesBufferBackEarly(ReferenceZeRO2):
    def _reduce(self, b):
        handle = super()._reduce(b)
        self._free.append(self._buffer_of.pop(b))     # (back to the pool while gloo still reads it)
        return handle

    def _complete(self, b):
        if b in self._out:
            _accumulate(self, b, self._out.pop(b))
        self._filled[b] = True
        if not self._pending and self._next == len(self.buckets.buckets):
            self._release_pool()


class AccumulatesInBf16(ReferenceZeRO2):
    def _complete(self, b):
        if b in self._out:
            self.grad_shards[b].add_(self._out.pop(b))   # (in the slice's own dtype, bf16 included)
        self._filled[b] = True
        self._free.append(self._buffer_of.pop(b))
        if not self._pending and self._next == len(self.buckets.buckets):
            self._release_pool()


class AccumulatesInFp64(ReferenceZeRO2):
    def _complete(self, b):
        if b in self._out:
            more = self._out.pop(b)
            if self._acc32[b] is None:
                self._acc32[b] = self.grad_shards[b].double()    # (fp64 "for precision", fp32 slices too)
            self._acc32[b].add_(more)
        self._filled[b] = True
        self._free.append(self._buffer_of.pop(b))
        if not self._pending and self._next == len(self.buckets.buckets):
            self._release_pool()


class UnpaddedBuffer(ReferenceZeRO2):
    def _reduce(self, b):
        bucket = self.buckets.buckets[b]
        flat = self._buffer(b)[:bucket.numel]      # (the real size: the padding left out)
        flat.div_(self.world_size)
        out = torch.empty(bucket.numel // self.world_size, dtype=flat.dtype)
        if self._filled[b]:
            self._out[b] = out
        else:
            self.grad_shards[b] = out
        return self.comm.reduce_scatter(out, flat, async_op=True, tag=f"bucket{b}")


class OverwritesSlice(ReferenceZeRO2):
    def _reduce(self, b):
        flat = self._buffer(b)[:self.buckets.buckets[b].padded_numel]
        flat.div_(self.world_size)
        self.grad_shards[b] = torch.empty(flat.numel() // self.world_size, dtype=flat.dtype)
        return self.comm.reduce_scatter(self.grad_shards[b], flat, async_op=True,   # (even at the second
                                        tag=f"bucket{b}")                            # micro-batch)


class AllReduces(ReferenceZeRO2):
    def _reduce(self, b):
        flat = self._buffer(b)[:self.buckets.buckets[b].padded_numel]
        flat.div_(self.world_size)
        return self.comm.all_reduce(flat, async_op=True, tag=f"bucket{b}")   # (every rank gets every slice)

    def _complete(self, b):
        mine = self._buffer_of[b][self.shards[b]].clone()
        if self._filled[b]:
            _accumulate(self, b, mine)
        else:
            self.grad_shards[b] = mine
        self._filled[b] = True
        self._free.append(self._buffer_of.pop(b))
        if not self._pending and self._next == len(self.buckets.buckets):
            self._release_pool()


class NoDivide(ReferenceZeRO2):
    def _reduce(self, b):
        flat = self._buffer(b)[:self.buckets.buckets[b].padded_numel]     # (never divided by N)
        out = torch.empty(flat.numel() // self.world_size, dtype=flat.dtype)
        if self._filled[b]:
            self._out[b] = out
        else:
            self.grad_shards[b] = out
        return self.comm.reduce_scatter(out, flat, async_op=True, tag=f"bucket{b}")


class KeepsPool(ReferenceZeRO2):
    def _complete(self, b):
        if b in self._out:
            _accumulate(self, b, self._out.pop(b))
        self._filled[b] = True
        self._free.append(self._buffer_of.pop(b))     # (the pool is never released)


class WaitsInReduce(ReferenceZeRO2):
    def _reduce(self, b):
        handle = super()._reduce(b)
        handle.wait()                   # (backward stands still while the bucket travels)
        return handle


class ReduceScatterNotAsync(ReferenceZeRO2):
    def _reduce(self, b):
        flat = self._buffer(b)[:self.buckets.buckets[b].padded_numel]
        flat.div_(self.world_size)
        out = torch.empty(flat.numel() // self.world_size, dtype=flat.dtype)
        if self._filled[b]:
            self._out[b] = out
        else:
            self.grad_shards[b] = out
        return self.comm.reduce_scatter(out, flat, tag=f"bucket{b}")     # (no async_op=True: returns None)


def _m(name, story, cls, expect):
    return Mistake(name, story, {"engine": cls}, expect)


MISTAKES = (
    _m("keeps_gradient", "copied each gradient into its bucket but kept p.grad", KeepsGradient,
       "full_gradient_held"),
    _m("gives_buffer_back_early", "gave the buffer back to the pool as soon as its reduce-scatter started",
       GivesBufferBackEarly, "buffer_reused_in_flight"),
    _m("accumulates_in_bf16", "added the second micro-batch in the slice's own dtype", AccumulatesInBf16,
       "accumulated_low"),
    _m("accumulates_in_fp64", "accumulated the second micro-batch in fp64", AccumulatesInFp64, "grad_dtype"),
    _m("unpadded_buffer", "reduce-scattered the bucket's real elements, without its padding", UnpaddedBuffer,
       "unpadded_buffer"),
    _m("overwrites_slice", "reduce-scattered every micro-batch into the owned slice itself",
       OverwritesSlice, "lost_micro_batch"),
    _m("all_reduces", "all-reduced each bucket and kept the owned slice", AllReduces, "all_reduce"),
    _m("no_divide", "reduce-scattered without dividing by N", NoDivide, "not_divided"),
    _m("keeps_pool", "never released the pool after the last bucket", KeepsPool, "pool_kept"),
    _m("waits_in_reduce", "waited for each bucket's reduce-scatter inside _reduce, right after starting it",
       WaitsInReduce, "blocking_reduce"),
    _m("reduce_scatter_not_async", "reduce-scattered each bucket without async_op=True", ReduceScatterNotAsync,
       "not_async"),
)
