"""Lab 3's planted mistakes: zl.DDP's own seams (ReferenceDDP) with one thing wrong, as students
write it. Each must fail the grader with the failure named in `expect`."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .ddp import ReferenceDDP
from .lab import Mistake


class NoDivide(ReferenceDDP):
    def _reduce(self, b):
        bucket, buf = self.buckets.buckets[b], self._flats[b]
        if b == len(self._flats) - 1:
            self._held = [p.grad is v for p, v in zip(self.params, self._grad_views)]
            buf[bucket.padded_numel:] = 1.0
        return self.comm.all_reduce(buf, async_op=True, tag=f"bucket{b}")   # (never divided by N)


class DividesTwice(ReferenceDDP):
    def _reduce(self, b):
        self._flats[b].div_(self.world_size)     # (and _ready_to_reduce divides the bucket once more)
        return super()._reduce(b)


class FreesPGrad(ReferenceDDP):
    def _take(self, p, b, i, k):
        self._grad_views[k].copy_(p.grad)
        p.grad = None                   # (ZeRO-2's habit: here the optimizer reads p.grad)


class FinishRelaunches(ReferenceDDP):
    def _finish_backward(self):
        for b in range(len(self.buckets.buckets)):     # (every bucket, those already launched too)
            self._launch(b)
        while self._pending:
            self._wait_oldest()


class GradNotAView(ReferenceDDP):
    def _take(self, p, b, i, k):
        view = self._grad_views[k]
        if p.grad is not view:
            view.copy_(p.grad)          # (p.grad is left pointing at autograd's own tensor)


class AddsToOldSlot(ReferenceDDP):
    def _take(self, p, b, i, k):
        view = self._grad_views[k]
        if p.grad is not view:
            view.add_(p.grad)           # (the slot still holds last step's gradient)
            p.grad = view


class LaunchesOnFirstGradient(ReferenceDDP):
    def _on_grad_ready(self, p):
        b, i, k = self._slot[id(p)]
        self._take(p, b, i, k)
        if not self._reducing_now:
            return
        self._missing[b] -= 1
        while self._next <= b:          # (launched as soon as ONE of its gradients is in)
            self._launch(self._next)


class LaunchesWhenFullInAnyOrder(ReferenceDDP):
    def _on_grad_ready(self, p):
        b, i, k = self._slot[id(p)]
        self._take(p, b, i, k)
        if not self._reducing_now:
            return
        self._missing[b] -= 1
        if self._missing[b] == 0:       # (the bucket that filled, whether or not the ones before it have)
            self._launch(b)


class ForgetsToWait(ReferenceDDP):
    def _finish_backward(self):
        while self._next < len(self.buckets.buckets):
            self._launch(self._next)
        self._held = [True] * len(self.params)      # (and never waits for what is in flight)


class LaunchesAfterBackward(ReferenceDDP):
    def _on_grad_ready(self, p):
        b, i, k = self._slot[id(p)]
        self._take(p, b, i, k)
        if self._reducing_now:
            self._missing[b] -= 1       # (counted, but nothing is launched until _finish_backward)


class OneAllReducePerGradient(ReferenceDDP):
    def _reduce(self, b):
        bucket = self.buckets.buckets[b]
        self._ready_to_reduce(b, bucket.grad)
        if b == len(self._flats) - 1:
            self._held = [True] * len(self.params)
        views = [bucket.grad_view(i) for i in range(len(bucket.params))]
        for view in views[:-1]:
            self.comm.all_reduce(view, tag=f"bucket{b}")    # (one call per gradient)
        return self.comm.all_reduce(views[-1], async_op=True, tag=f"bucket{b}")


class ReducesInNoSync(ReferenceDDP):
    def _on_grad_ready(self, p):
        b, i, k = self._slot[id(p)]
        self._take(p, b, i, k)
        self._missing[b] -= 1           # (no_sync ignored: every micro-batch communicates)
        while self._next < len(self._missing) and self._missing[self._next] == 0:
            self._launch(self._next)


class WaitsInReduce(ReferenceDDP):
    def _reduce(self, b):
        handle = super()._reduce(b)
        handle.wait()                   # (backward stands still while the bucket travels)
        return handle


class AllReduceNotAsync(ReferenceDDP):
    def _reduce(self, b):
        bucket, buf = self.buckets.buckets[b], self._flats[b]
        self._ready_to_reduce(b, bucket.grad)
        if b == len(self._flats) - 1:
            self._held = [p.grad is v for p, v in zip(self.params, self._grad_views)]
            buf[bucket.padded_numel:] = torch.tensor(self._held, dtype=buf.dtype)
        return self.comm.all_reduce(buf, tag=f"bucket{b}")     # (no async_op=True: returns None, done)


class AllReduceOutsideTheLedger(ReferenceDDP):
    def _reduce(self, b):
        bucket, buf = self.buckets.buckets[b], self._flats[b]
        self._ready_to_reduce(b, bucket.grad)
        if b == len(self._flats) - 1:
            self._held = [p.grad is v for p, v in zip(self.params, self._grad_views)]
            buf[bucket.padded_numel:] = torch.tensor(self._held, dtype=buf.dtype)
        return dist.all_reduce(buf, async_op=True)      # (torch.distributed's own, not self.comm)


class OnlyWaitsAtTheEnd(ReferenceDDP):
    def _finish_backward(self):
        while self._pending:            # (a bucket that never filled is never launched)
            self._wait_oldest()


def _m(name, story, cls, expect):
    return Mistake(name, story, {"engine": cls}, expect)


MISTAKES = (
    _m("no_divide", "all-reduced the buckets without dividing by N", NoDivide, "not_divided"),
    _m("divides_twice", "divided each bucket by N in _reduce, where it is already divided", DividesTwice,
       "divided_twice"),
    _m("frees_p_grad", "copied each gradient into its slot and set p.grad to None", FreesPGrad, "no_grad"),
    _m("finish_relaunches", "launched every bucket in _finish_backward, those already launched too",
       FinishRelaunches, "reduced_twice"),
    _m("grad_not_a_view", "copied the gradient into the bucket but left p.grad as it was", GradNotAView,
       "not_reduced"),
    _m("adds_to_old_slot", "added the step's first gradient to its slot instead of copying it",
       AddsToOldSlot, "not_reset"),
    _m("launches_on_first_gradient", "launched a bucket when its first gradient arrived",
       LaunchesOnFirstGradient, "launched_early"),
    _m("launches_when_full_in_any_order", "launched each bucket the moment it filled, ahead of an earlier "
       "bucket still waiting for a gradient", LaunchesWhenFullInAnyOrder, "out_of_order"),
    _m("forgets_to_wait", "launched the last buckets but did not wait for them", ForgetsToWait, "not_waited"),
    _m("launches_after_backward", "launched every bucket at the end of backward", LaunchesAfterBackward,
       "no_overlap"),
    _m("one_all_reduce_per_gradient", "all-reduced each gradient of a bucket on its own",
       OneAllReducePerGradient, "per_parameter"),
    _m("reduces_in_no_sync", "reduced the buckets inside no_sync() too", ReducesInNoSync,
       "reduced_in_no_sync"),
    _m("waits_in_reduce", "waited for each bucket's all-reduce inside _reduce, right after starting it",
       WaitsInReduce, "blocking_reduce"),
    _m("all_reduce_not_async", "all-reduced each bucket without async_op=True", AllReduceNotAsync, "not_async"),
    _m("all_reduce_outside_the_ledger", "all-reduced with torch.distributed instead of the engine's ledger",
       AllReduceOutsideTheLedger, "not_the_ledger"),
    _m("only_waits_at_the_end", "at the end of backward waited for the buckets in flight, launching none",
       OnlyWaitsAtTheEnd, "not_launched"),
)
