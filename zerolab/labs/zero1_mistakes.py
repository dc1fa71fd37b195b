"""Lab 4's planted mistakes: ZeRO-1's own seams (ReferenceZeRO1) with one thing wrong, as students
write it. Each must fail the grader with the failure named in `expect`."""

from __future__ import annotations

from .lab import Mistake
from .zero1 import ReferenceZeRO1


class AllReduces(ReferenceZeRO1):
    def _reduce(self, b):
        flat = self._grad_bucket(b)
        self._ready_to_reduce(b, flat)
        return self.comm.all_reduce(flat, async_op=True, tag=f"bucket{b}")   # (every rank gets every slice)

    def _complete(self, b):
        pass                            # (the owned slice of the all-reduced buffer is already the mean)


class UnpaddedSlices(ReferenceZeRO1):
    def _lay_out_masters(self):
        size = [b.numel // self.world_size for b in self.buckets.buckets]   # (the real size, not the padded)
        self.shards = [slice(self.rank * s, (self.rank + 1) * s) for s in size]
        self.buckets.bind_params()
        self.master_shards = [b.data[s] for b, s in zip(self.buckets.buckets, self.shards)]
        self.flat_masters = self.masters = self.master_shards
        self._out = {}


class CompletesIntoSliceZero(ReferenceZeRO1):
    def _complete(self, b):
        out = self._out.pop(b)
        self.buckets.buckets[b].grad[:out.numel()].copy_(out)   # (slice 0, whoever the rank)


class AddsResult(ReferenceZeRO1):
    def _complete(self, b):
        self.buckets.buckets[b].grad[self.shards[b]].add_(self._out.pop(b))   # (onto the local gradient)


class NoDivide(ReferenceZeRO1):
    def _reduce(self, b):
        flat = self._grad_bucket(b)     # (never divided by N)
        self._out[b] = flat.new_empty(flat.numel() // self.world_size)
        return self.comm.reduce_scatter(self._out[b], flat, async_op=True, tag=f"bucket{b}")


class CopiedMasters(ReferenceZeRO1):
    def _lay_out_masters(self):
        super()._lay_out_masters()
        # (the fp16 habit, in fp32: the optimizer steps copies that never reach the model)
        self.master_shards[:] = [m.detach().clone() for m in self.master_shards]


class MastersInFp64(ReferenceZeRO1):
    def _lay_out_masters(self):
        super()._lay_out_masters()
        # (fp64 masters "for precision": casts, hence copies the optimizer steps)
        self.master_shards[:] = [m.double() for m in self.master_shards]


class NoAllGather(ReferenceZeRO1):
    def _publish(self):
        pass                            # (fp32: the owned slices are updated in place; the rest never arrives)


def _m(name, story, cls, expect):
    return Mistake(name, story, {"engine": cls}, expect)


MISTAKES = (
    _m("all_reduces", "all-reduced the gradient buckets and kept the owned slice", AllReduces, "all_reduce"),
    _m("unpadded_slices", "cut the slices from the real size of a bucket, not its padded size",
       UnpaddedSlices, "wrong_slice"),
    _m("completes_into_slice_zero", "wrote the reduce-scatter's result at the start of the bucket",
       CompletesIntoSliceZero, "result_elsewhere"),
    _m("adds_result", "added the reduce-scatter's result to the owned slice", AddsResult, "added_to_local"),
    _m("no_divide", "reduce-scattered without dividing by N", NoDivide, "not_divided"),
    _m("no_all_gather", "stepped the owned slices but never all-gathered the parameters", NoAllGather,
       "not_updated"),
    _m("copied_masters", "made the master slices copies of the buckets, not views", CopiedMasters,
       "not_updated_own"),
    _m("masters_in_fp64", "cast the master slices to fp64", MastersInFp64, "master_dtype"),
)
