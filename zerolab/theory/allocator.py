"""A small model of a caching allocator, to see memory fragmentation (ZeRO-R's M_D).

A GPU allocator carves requests out of large reserved segments. When short-lived tensors
(activations being recomputed, activation gradients) are interleaved with long-lived ones
(checkpoints, parameter gradients), the long-lived ones pin little islands in the middle
of the segment and the free memory around them is broken into pieces: a request can fail
although enough memory is free in total.

This model replays a real allocation/free trace (zerolab.memory.AllocationTracker with
record_trace=True) in one growing arena, best-fit with coalescing of neighbours, sizes
rounded up to `round_to` bytes, and reports:

    peak_live        the most bytes alive at once (what perfect packing would need)
    reserved         the arena's high-water mark under this allocator
    stranded         the largest request that found enough free memory in the arena but no
                     single block big enough: on a device with no room to grow it would fail
                     for lack of CONTIGUOUS space (an "OOM with memory free")

M_D ("defragment by pre-allocating"): allocations classified as long-lived are served
from one contiguous region reserved up front, so they never split the general arena.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass
class ReplayResult:
    peak_live: int
    reserved: int
    stranded: int                # the largest request that fit in free bytes but in no free block
    free_then: int               # free bytes in the arena at that request
    largest_free_then: int       # the largest free block at that request
    failed_at: int | None        # trace index of the first request that did not fit (capacity set)

    @property
    def fragmentation(self) -> float:
        """Reserved bytes beyond what perfect packing would need, as a fraction of reserved."""
        return 0.0 if self.reserved == 0 else 1 - self.peak_live / self.reserved


class Arena:
    """Best-fit placement in one address range; free neighbours merge."""

    def __init__(self, round_to: int = 512, capacity: int | None = None):
        self.round_to, self.capacity = round_to, capacity
        self.free: list = []         # sorted [(offset, size)] of free blocks below `end`
        self.end = 0                 # the arena's high-water mark
        self.blocks: dict = {}       # block id -> (offset, size)

    def size_of(self, nbytes: int) -> int:
        return -(-nbytes // self.round_to) * self.round_to

    def malloc(self, block, nbytes: int) -> bool:
        size = self.size_of(nbytes)
        fits = [(s, o) for o, s in self.free if s >= size]
        if fits:
            s, o = min(fits)                       # best fit: the smallest block that is big enough
            self.free.remove((o, s))
            if s > size:
                bisect.insort(self.free, (o + size, s - size))
        else:
            # grow the arena, reusing a free block that touches the end
            tail = self.free[-1] if self.free and sum(self.free[-1]) == self.end else None
            o = tail[0] if tail else self.end
            if self.capacity is not None and o + size > self.capacity:
                return False
            if tail:
                self.free.pop()
            self.end = o + size
        self.blocks[block] = (o, size)
        return True

    def release(self, block) -> None:
        o, s = self.blocks.pop(block)
        i = bisect.bisect(self.free, (o, s))
        if i < len(self.free) and self.free[i][0] == o + s:          # merge with the next block
            s += self.free.pop(i)[1]
        if i > 0 and sum(self.free[i - 1]) == o:                     # merge with the previous one
            po, ps = self.free.pop(i - 1)
            o, s = po, ps + s
        bisect.insort(self.free, (o, s))

    def free_bytes(self) -> int:
        return sum(s for _, s in self.free)

    def largest_free(self) -> int:
        return max((s for _, s in self.free), default=0)


def lifetimes(trace) -> dict:
    """block id -> (alloc index, free index or None, bytes), from (index, delta, op, block) events."""
    out = {}
    for e in trace:
        index, delta, block = e[0], e[1], e[3]
        if delta > 0:
            out[block] = [index, None, delta]
        elif block in out:
            out[block][1] = index
    return {b: tuple(v) for b, v in out.items()}


def long_lived(trace, fraction: float = 0.25) -> set:
    """Blocks alive for more than `fraction` of the trace, or still alive at its end."""
    n = max(1, len(trace))
    return {b for b, (start, end, _) in lifetimes(trace).items()
            if end is None or (end - start) > fraction * n}


def replay(trace, *, defragment: set | None = None, round_to: int = 512,
           capacity: int | None = None) -> ReplayResult:
    """Replay a trace; blocks in `defragment` come from a pre-allocated contiguous region (M_D)."""
    defragment = defragment or set()
    life = lifetimes(trace)
    pool = Arena(round_to)
    # M_D: one contiguous region sized for the long-lived blocks alive at the same time
    pool_bytes, live_pool = 0, 0
    for e in trace:
        if e[3] in defragment:
            live_pool += pool.size_of(abs(e[1])) * (1 if e[1] > 0 else -1)
            pool_bytes = max(pool_bytes, live_pool)
    arena = Arena(round_to, None if capacity is None else capacity - pool_bytes)
    live = peak = 0
    stranded, free_then, largest_then, failed = 0, 0, 0, None
    for e in trace:
        index, delta, block = e[0], e[1], e[3]
        if block not in life:
            continue
        live += delta
        peak = max(peak, live)
        if block in defragment:
            continue                               # lives in the pre-allocated region
        if delta > 0:
            size = arena.size_of(delta)
            if arena.largest_free() < size <= arena.free_bytes() and size > stranded:
                stranded, free_then, largest_then = size, arena.free_bytes(), arena.largest_free()
            if not arena.malloc(block, delta) and failed is None:
                failed = index
        elif block in arena.blocks:
            arena.release(block)
    return ReplayResult(peak_live=peak, reserved=arena.end + pool_bytes, stranded=stranded,
                        free_then=free_then, largest_free_then=largest_then, failed_at=failed)
