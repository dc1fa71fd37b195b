"""Lab 6's planted mistakes: ZeRO-3's own unit lifecycle and prefetch (ReferenceUnit,
ReferenceZeRO3) with one thing wrong, as students write it. Each must fail the grader with the
failure named in `expect`."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .lab import Mistake
from .zero3 import ReferenceUnit, ReferenceZeRO3, mark_released, storage_alloc, storage_free


class PrefetchesTwoAhead(ReferenceZeRO3):
    def _prefetch_after(self, order, u, phase):
        i = order.index(u)
        for v in order[i + 2:i + 2 + self.prefetch]:      # (skips the unit needed next)
            v.gather(phase)


class PrefetchesTooMany(ReferenceZeRO3):
    def _prefetch_after(self, order, u, phase):
        if self.prefetch == 0 or u not in order:
            return
        i = order.index(u)
        ahead = [v for v in order[i + 1:] if not (phase == "backward" and v.reduced)]
        for v in ahead[:self.prefetch + 1]:     # (the next unit and the one after it)
            v.gather(phase)


class PrefetchesItself(ReferenceZeRO3):
    def _prefetch_after(self, order, u, phase):
        u.gather(phase)                 # (u is already being gathered: nothing travels ahead)


class NoDivide(ReferenceUnit):
    def reduce_scatter(self):
        b = self.buckets["train"]
        if self.grad_full is None:
            self.grad_full = torch.zeros(b.padded_numel, dtype=b.data.dtype)
        out = torch.empty(b.padded_numel // b.world_size, dtype=self.grad_full.dtype)   # (never divided by N)
        self._rs = (self.comm.reduce_scatter(out, self.grad_full, async_op=True, tag=f"reduce:{self.name}"), out)


class ShardWithoutPadding(ReferenceUnit):
    def reduce_scatter(self):
        b = self.buckets["train"]
        if self.grad_full is None:
            self.grad_full = torch.zeros(b.padded_numel, dtype=b.data.dtype)
        else:
            self.grad_full.div_(b.world_size)
        out = torch.empty(b.numel // b.world_size, dtype=self.grad_full.dtype)     # (the real size's share)
        self._rs = (self.comm.reduce_scatter(out, self.grad_full, async_op=True, tag=f"reduce:{self.name}"), out)


class OverwritesShard(ReferenceUnit):
    def finish_reduce(self):
        handle, out = self._rs
        handle.wait()
        self._rs, self.grad_full = None, None
        self.grad_shard = out           # (a second micro-batch replaces the first)


class ShardInFp64(ReferenceUnit):
    def finish_reduce(self):
        handle, out = self._rs
        handle.wait()
        self._rs, self.grad_full = None, None
        out = out.double()              # (the shard kept in fp64 "for precision")
        self.grad_shard = out if self.grad_shard is None else self.grad_shard + out


class KeepsFullGradient(ReferenceUnit):
    def finish_reduce(self):
        handle, out = self._rs
        handle.wait()
        self._rs = None                 # (grad_full is kept)
        self.grad_shard = out if self.grad_shard is None else self.grad_shard + out


class KeepsMemory(ReferenceUnit):
    def release(self, phase):
        if self.handles:
            self.wait(phase)
        if not self.gathered:
            return
        mark_released(self.params, True)    # (marked released, but the memory is not freed)
        self.gathered = False


class WaitDoesNotWait(ReferenceUnit):
    def wait(self, phase):
        if self.gathered:
            return 0.0
        self.gather(phase)
        self.handles = {}               # (forgets the handles without waiting for them)
        self.gathered = True
        mark_released(self.params, False)
        return 0.0


class AllReduces(ReferenceUnit):
    def reduce_scatter(self):
        b = self.buckets["train"]
        if self.grad_full is None:
            self.grad_full = torch.zeros(b.padded_numel, dtype=b.data.dtype)
        self.grad_full.div_(b.world_size)
        handle = self.comm.all_reduce(self.grad_full, async_op=True, tag=f"reduce:{self.name}")
        self._rs = (handle, None)

    def finish_reduce(self):
        handle, _ = self._rs
        handle.wait()
        mine = self.grad_full[self.buckets["train"].shard(dist.get_rank())].clone()
        self._rs, self.grad_full = None, None
        self.grad_shard = mine if self.grad_shard is None else self.grad_shard + mine


class GathersInPlace(ReferenceUnit):
    def gather(self, phase):
        if self.gathered or self.handles:
            return
        for kind, full in self.full.items():
            storage_alloc(full)
            self.comm.all_gather(full, self.shard[kind], async_op=True, tag=f"gather:{self.name}").wait()
        self.gathered = True            # (waited in place: returns only once the unit has arrived)
        mark_released(self.params, False)


class StalePrefetch(ReferenceZeRO3):
    def _prefetch_after(self, order, u, phase):
        if self.prefetch == 0 or u not in order:
            return
        i = order.index(u)
        for v in order[i + 1:i + 1 + self.prefetch]:     # (in backward, a unit already done too)
            v.gather(phase)


class PrefetchStopsAtDone(ReferenceZeRO3):
    def _prefetch_after(self, order, u, phase):
        if self.prefetch == 0 or u not in order:
            return
        i = order.index(u)
        for v in order[i + 1:i + 1 + self.prefetch]:
            if not (phase == "backward" and v.reduced):  # (skips a done unit, gathers none in its place)
                v.gather(phase)


class ReleasesInFlight(ReferenceUnit):
    def release(self, phase):
        if not self.gathered and not self.handles:
            return
        mark_released(self.params, True)
        for full in self.full.values():
            storage_free(full)          # (a prefetch's all-gather may still be writing into it)
        self.handles, self.gathered = {}, False


class ForgetsStorageAlloc(ReferenceUnit):
    def gather(self, phase):
        if self.gathered or self.handles:
            return
        for kind, full in self.full.items():            # (the buffer's memory is still freed)
            self.handles[kind] = self.comm.all_gather(full, self.shard[kind], async_op=True,
                                                      tag=f"gather:{self.name}")


class GathersIntoNewBuffer(ReferenceUnit):
    def gather(self, phase):
        if self.gathered or self.handles:
            return
        for kind, full in self.full.items():
            fresh = torch.empty(full.numel(), dtype=full.dtype)     # (the parameters look at the old one)
            self.handles[kind] = self.comm.all_gather(fresh, self.shard[kind], async_op=True,
                                                      tag=f"gather:{self.name}")
            self.full[kind] = fresh


class LeavesParametersReleased(ReferenceUnit):
    def wait(self, phase):
        if self.gathered:
            return 0.0
        self.gather(phase)
        for h in self.handles.values():
            h.wait()
        self.handles, self.gathered = {}, True      # (the parameters are never made readable again)
        return 0.0


class LeavesFreedMemoryReadable(ReferenceUnit):
    def release(self, phase):
        if self.handles:
            self.wait(phase)
        if not self.gathered:
            return
        for full in self.full.values():
            storage_free(full)          # (freed, but the parameters are not marked released)
        self.gathered = False


class WaitsInReduceScatter(ReferenceUnit):
    def reduce_scatter(self):
        super().reduce_scatter()
        self._rs[0].wait()              # (backward stands still while the gradient travels)


def _unit(name, story, cls, expect):
    return Mistake(name, story, {"unit": cls}, expect)


def _engine(name, story, cls, expect):
    return Mistake(name, story, {"engine": cls}, expect)


MISTAKES = (
    _engine("prefetches_two_ahead", "prefetched the unit after the next one", PrefetchesTwoAhead,
            "prefetch_wrong_unit"),
    _engine("prefetches_too_many", "gathered two units ahead where prefetch is 1", PrefetchesTooMany,
            "prefetch_too_far"),
    _engine("prefetches_itself", "prefetched the unit that was about to run anyway", PrefetchesItself,
            "no_prefetch"),
    _unit("no_divide", "reduce-scattered the gradient without dividing by N", NoDivide, "not_divided"),
    _unit("shard_without_padding", "sized the gradient shard from the unit's real size, not its padded one",
          ShardWithoutPadding, "unpadded_shard"),
    _unit("overwrites_shard", "kept the last micro-batch's gradient shard instead of adding to it",
          OverwritesShard, "lost_micro_batch"),
    _unit("shard_in_fp64", "kept the reduced gradient shard in fp64", ShardInFp64, "grad_dtype"),
    _unit("keeps_full_gradient", "kept the full gradient after its reduce-scatter", KeepsFullGradient,
          "full_gradient_kept"),
    _unit("keeps_memory", "released a unit without freeing its memory", KeepsMemory, "parameters_kept"),
    _unit("wait_does_not_wait", "marked a unit gathered without waiting for its all-gather",
          WaitDoesNotWait, "used_before_gathered"),
    _unit("all_reduces", "all-reduced the unit's gradient and kept this rank's shard", AllReduces,
          "all_reduce"),
    _unit("gathers_in_place", "waited for the all-gather inside gather()", GathersInPlace, "blocking_gather"),
    _engine("stale_prefetch", "prefetched in backward a unit whose backward was already done", StalePrefetch,
            "stale_prefetch"),
    _engine("prefetch_stops_at_done", "skipped a unit whose backward was done, but gathered none in its place",
            PrefetchStopsAtDone, "prefetch_not_past_done"),
    _unit("releases_in_flight", "freed a unit's buffer while a prefetch was still gathering into it",
          ReleasesInFlight, "released_in_flight"),
    _unit("forgets_storage_alloc", "gathered into the full buffer without giving it its memory back",
          ForgetsStorageAlloc, "not_allocated"),
    _unit("gathers_into_new_buffer", "gathered into a new tensor instead of the unit's own buffer",
          GathersIntoNewBuffer, "gathered_elsewhere"),
    _unit("leaves_parameters_released", "never marked the gathered parameters readable again",
          LeavesParametersReleased, "still_released"),
    _unit("leaves_freed_memory_readable", "freed the buffer without marking its parameters released",
          LeavesFreedMemoryReadable, "release_not_marked"),
    _unit("waits_in_reduce_scatter", "waited for the reduce-scatter inside reduce_scatter()",
          WaitsInReduceScatter, "blocking_reduce_scatter"),
)
