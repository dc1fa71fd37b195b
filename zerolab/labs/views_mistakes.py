"""Lab 7's planted mistakes: the library's own ParamViews seams (ReferenceViews) with one thing
wrong, as students write it. Each must fail the grader with the failure named in `expect`."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .lab import Mistake
from .views import ReferenceViews, unpack


class ViewCopies(ReferenceViews):
    def _cut(self, i, flat, bucket, s):
        super()._cut(i, flat, bucket, s)
        for p in bucket.params:
            self.view_of[id(p)] = self.view_of[id(p)].clone()     # (a copy of the master's elements)


class CutOffByOne(ReferenceViews):
    def _cut(self, i, flat, bucket, s):
        for p, o, n in zip(bucket.params, bucket.offsets, bucket.sizes):
            first, last = max(o, s.start), min(o + n, s.stop) - 1     # (the last element inside, included ...)
            if first <= last:
                view = flat[first - s.start:last - s.start]           # (... but a slice's end is excluded)
                if view.numel() == n:
                    view = view.view(p.shape)
                self.where[id(p)] = (i, first - s.start, last - s.start)
                self.piece[id(p)] = (first - o, last - o)
            else:
                view = flat[:0]
                self.where[id(p)], self.piece[id(p)] = (i, 0, 0), (0, 0)
            self.view_of[id(p)] = view


class CutWithoutPadding(ReferenceViews):
    def _cut(self, i, flat, bucket, s):
        n, r = dist.get_world_size(), dist.get_rank()
        size = bucket.numel // n                # (the real size: the bucket's padding left out)
        start, stop = r * size, (r + 1) * size
        for p, o, k in zip(bucket.params, bucket.offsets, bucket.sizes):
            lo, hi = max(o, start), min(o + k, stop)
            if lo < hi:
                view = flat[lo - start:hi - start]
                if hi - lo == k:
                    view = view.view(p.shape)
                self.where[id(p)], self.piece[id(p)] = (i, lo - start, hi - start), (lo - o, hi - o)
            else:
                view = flat[:0]
                self.where[id(p)], self.piece[id(p)] = (i, 0, 0), (0, 0)
            self.view_of[id(p)] = view


class ViewsInFp16(ReferenceViews):
    def _cut(self, i, flat, bucket, s):
        super()._cut(i, flat, bucket, s)
        for p in bucket.params:
            self.view_of[id(p)] = self.view_of[id(p)].half()     # (half the memory, thought the student)


class FlattensWholeViews(ReferenceViews):
    def _cut(self, i, flat, bucket, s):
        super()._cut(i, flat, bucket, s)
        for p in bucket.params:
            self.view_of[id(p)] = self.view_of[id(p)].view(-1)     # (a whole parameter left flat)


class PlacesInBucketOrder(ReferenceViews):
    def place(self, optimizer, moved=None):
        self.order = []
        for group in optimizer.param_groups:
            mine = {id(p) for p in group["params"]}
            ordered = [p for p in self.params if id(p) in mine]    # (the buckets' order, not the group's)
            group["params"] = [self.view_of[id(p)] for p in ordered]
            self.order += ordered


class SkippedGetsZeroGrad(ReferenceViews):
    def point_grads(self, skip=(), only=None):
        super().point_grads((), only)       # (skip ignored: a parameter no rank reached gets its zeros)


class EmptyViewGetsGrad(ReferenceViews):
    def point_grads(self, skip=(), only=None):
        grads = [m.grad for m in self.masters]
        for p in self.params:
            i, lo, hi = self.where[id(p)]
            view = self.view_of[id(p)]
            if id(p) in skip:
                view.grad = None
            else:                           # (an empty view gets an empty gradient)
                view.grad = grads[i][lo:hi].view(view.shape)


class CopiesGradients(ReferenceViews):
    def point_grads(self, skip=(), only=None):
        grads = [m.grad for m in self.masters]
        for p in self.params:
            i, lo, hi = self.where[id(p)]
            view = self.view_of[id(p)]
            if lo == hi or id(p) in skip:
                view.grad = None
            else:
                view.grad = grads[i][lo:hi].clone().view(view.shape)   # (a copy of the flat gradient's range)


class GradsFromTheStart(ReferenceViews):
    def point_grads(self, skip=(), only=None):
        grads = [m.grad for m in self.masters]
        for p in self.params:
            i, lo, hi = self.where[id(p)]
            view = self.view_of[id(p)]
            if lo == hi or id(p) in skip:
                view.grad = None
            else:
                view.grad = grads[i][:hi - lo].view(view.shape)     # (as many elements, from the master's first)


class SliceAsWhole(ReferenceViews):
    def assemble(self, local, blobs):
        return dict(sorted(local.items()))  # (this rank's pieces, as if they were the whole)


def _assemble(views, local, blobs, own_scalars=False, shaped=True, dtype=None, from_start=False) -> dict:
    received = {}
    for blob in blobs:
        for k, piece in unpack(blob).items():
            received.setdefault(k, []).append(piece)
    out = {}
    for k, p in views._index():
        if k not in received:
            continue
        shape, state, whole = views.shape[id(p)], {}, {}
        for lo, hi, entries in received[k]:
            for key, value in entries.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    t = whole.setdefault(key, torch.zeros(math.prod(shape), dtype=dtype or value.dtype))
                    if from_start:
                        t[:hi - lo] = value.reshape(-1)
                    else:
                        t[lo:hi] = value.reshape(-1)
                elif not own_scalars:
                    state[key] = value
        if own_scalars:                     # (the scalars of this rank's own piece: none if it holds none)
            state = {key: v for key, v in local.get(k, {}).items() if not (torch.is_tensor(v) and v.dim() > 0)}
        state.update({key: (t.view(shape) if shaped else t) for key, t in whole.items()})
        out[k] = state
    return dict(sorted(out.items()))


class ScalarsFromOwnRank(ReferenceViews):
    def assemble(self, local, blobs):
        return _assemble(self, local, blobs, own_scalars=True)


class LeavesStateFlat(ReferenceViews):
    def assemble(self, local, blobs):
        return _assemble(self, local, blobs, shaped=False)     # (each whole tensor left flat)


def _shard(views, state, groups, start=True, drop_empty=True, dtype=None) -> dict:
    position = {key: k for k, key in enumerate(key for g in groups for key in g["params"])}
    out = dict(state)
    for key, entries in state.items():
        p = views.order[position[key]]
        lo, hi = views.piece[id(p)]
        if lo == hi:
            if drop_empty:
                del out[key]
            continue                        # (drop_empty=False: the whole entry stays)
        view = views.view_of[id(p)]
        out[key] = {name: (v.reshape(-1)[lo:hi] if start else v.reshape(-1)[:hi - lo]).reshape(view.shape)
                    .to(dtype or v.dtype).clone() if torch.is_tensor(v) and v.dim() > 0 else v
                    for name, v in entries.items()}
    return out


class AssemblesFromTheStart(ReferenceViews):
    def assemble(self, local, blobs):
        return _assemble(self, local, blobs, from_start=True)      # (every piece at element 0)


class AssemblesInFp16(ReferenceViews):
    def assemble(self, local, blobs):
        return _assemble(self, local, blobs, dtype=torch.float16)  # (the whole tensors made in fp16)


class AssemblesInFp64(ReferenceViews):
    def assemble(self, local, blobs):
        return _assemble(self, local, blobs, dtype=torch.float64)  # (the whole tensors made in fp64)


class LoadsInFp16(ReferenceViews):
    def shard(self, state, groups):
        return _shard(self, state, groups, dtype=torch.float16)    # (each piece cast to fp16)


class LoadsWhole(ReferenceViews):
    def shard(self, state, groups):
        return dict(state)                  # (every rank keeps the whole model's state)


class LoadsFromTheStart(ReferenceViews):
    def shard(self, state, groups):
        return _shard(self, state, groups, start=False)     # (the piece's length, from element 0)


class LoadsStateForEmpty(ReferenceViews):
    def shard(self, state, groups):
        return _shard(self, state, groups, drop_empty=False)


def _m(name, story, cls, expect):
    return Mistake(name, story, {"views": cls}, expect)


MISTAKES = (
    _m("view_copies", "cut each view as a copy of the master's elements, not a view of them", ViewCopies,
       "view_copy"),
    _m("cut_off_by_one", "took the last element inside the slice as a slice's end, one element short", CutOffByOne,
       "view_off_by_one"),
    _m("cut_without_padding", "computed the rank's slice from the bucket's real size, not the padded one it is given",
       CutWithoutPadding, "view_unpadded"),
    _m("views_in_fp16", "cut the views in fp16", ViewsInFp16, "view_dtype"),
    _m("flattens_whole_views", "left every view flat, a whole matrix included", FlattensWholeViews, "view_shape"),
    _m("places_in_bucket_order", "put the views in each group in the buckets' order, not the script's",
       PlacesInBucketOrder, "wrong_place"),
    _m("skipped_gets_zero_grad", "gave a parameter no rank reached its range of the flat gradient (zeros)",
       SkippedGetsZeroGrad, "grad_to_skipped"),
    _m("empty_view_gets_grad", "gave an empty view an empty gradient", EmptyViewGetsGrad, "grad_to_empty"),
    _m("copies_gradients", "gave each view a copy of its range of the flat gradient", CopiesGradients, "grad_copy"),
    _m("grads_from_the_start", "gave each view as many elements of the flat gradient, from its first",
       GradsFromTheStart, "grad_range"),
    _m("slice_as_whole", "returned this rank's own state from state_dict(), as if it were the whole", SliceAsWhole,
       "state_slice"),
    _m("scalars_from_own_rank", "took each parameter's step count from this rank's own state", ScalarsFromOwnRank,
       "state_scalar"),
    _m("leaves_state_flat", "put each parameter's state together flat, not in its shape", LeavesStateFlat,
       "state_shape"),
    _m("assembles_from_the_start", "put every piece of a parameter's state at its first element",
       AssemblesFromTheStart, "state_values"),
    _m("assembles_in_fp16", "put each parameter's state together in fp16 tensors", AssemblesInFp16, "state_rounded"),
    _m("assembles_in_fp64", "put each parameter's state together in fp64 tensors", AssemblesInFp64, "state_widened"),
    _m("loads_whole", "loaded the whole state dict on every rank, uncut", LoadsWhole, "loaded_whole"),
    _m("loads_from_the_start", "cut each loaded tensor from the parameter's first element", LoadsFromTheStart,
       "loaded_values"),
    _m("loads_in_fp16", "cast each loaded piece to fp16", LoadsInFp16, "loaded_rounded"),
    _m("loads_state_for_empty", "kept the checkpoint's entry for a parameter with no element on this rank",
       LoadsStateForEmpty, "loaded_for_empty"),
)
