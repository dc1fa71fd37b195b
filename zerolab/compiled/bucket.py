"""Pass (c), bucket: neighbouring collectives of one kind merged into one, up to a size.

A collective costs a fixed latency plus its bytes, so a few large ones beat many small ones.
Rank r's shard of each tensor must stay rank r's, so a bucket interleaves them: every tensor
is seen as `world` rows of its shards, and the rows are concatenated side by side. Row r of
the bucket is then rank r's shard of every tensor in it, as FSDP2 lays out its all-gathers.

    reduce-scatters: the gradients wait for the last of their bucket, then move as one
    all-gathers:     one gather before the first weight is read, then each weight copied out

Buckets never cross from the forward to the backward: that would keep weights alive across
the gap that ZeRO-3 frees them in.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from . import collectives
from .capture import Step
from .nodes import meta_like, positions

aten = torch.ops.aten


def _call(step, target, args, val, kwargs=None) -> fx.Node:
    node = step.graph.call_function(target, args, kwargs or {})
    node.meta["val"] = val
    return node


def neighbours(step: Step, kind, cap_bytes: int) -> list:
    """Runs of consecutive starts of `kind`, each at most cap_bytes (a larger one alone)."""
    pos = positions(step.graph)
    loss_at = pos[step.loss_node()]
    groups, size, region = [], 0, None
    for node in [n for n in step.graph.nodes if n.target is kind]:
        val = node.args[0].meta["val"]
        nbytes = val.numel() * val.dtype.itemsize * (node.args[1] if kind is collectives.all_gather_start else 1)
        here = pos[node] > loss_at
        if groups and size + nbytes <= cap_bytes and here == region:
            groups[-1].append(node)
            size += nbytes
        else:
            groups.append([node])
            size, region = nbytes, here
    return [g for g in groups if len(g) > 1]


def _wait_of(start: fx.Node) -> fx.Node:
    return next(u for u in start.users if u.target is collectives.wait)


def merge_reduce_scatters(step: Step, starts: list) -> None:
    world = starts[0].args[1]
    flats = [s.args[0] for s in starts]
    sizes = [f.meta["val"].numel() // world for f in flats]
    val = flats[0].meta["val"]
    with step.graph.inserting_before(starts[-1]):
        rows = [_call(step, aten.view.default, (f, [world, n]), meta_like((world, n), val)) for f, n in zip(flats, sizes)]
        grid = _call(step, aten.cat.default, (rows, 1), meta_like((world, sum(sizes)), val))
        flat = _call(step, aten.view.default, (grid, [-1]), meta_like((world * sum(sizes),), val))
        start = _call(step, collectives.reduce_scatter_start, (flat, world), None)
        out = _call(step, collectives.wait, (start,), meta_like((sum(sizes),), val))
        parts = _call(step, aten.split_with_sizes.default, (out, sizes), [meta_like((n,), val) for n in sizes])
        for i, old in enumerate(starts):
            shard = _call(step, operator.getitem, (parts, i), meta_like((sizes[i],), val))
            _wait_of(old).replace_all_uses_with(shard)
    for old in starts:
        step.graph.erase_node(_wait_of(old))
        step.graph.erase_node(old)


def merge_all_gathers(step: Step, starts: list) -> None:
    world = starts[0].args[1]
    shards = [s.args[0] for s in starts]
    sizes = [s.meta["val"].numel() for s in shards]
    val = shards[0].meta["val"]
    with step.graph.inserting_before(starts[0]):
        mine = _call(step, aten.cat.default, (shards,), meta_like((sum(sizes),), val))
        start = _call(step, collectives.all_gather_start, (mine, world), None)
    first_wait = min((_wait_of(s) for s in starts), key=positions(step.graph).__getitem__)
    with step.graph.inserting_before(first_wait):
        flat = _call(step, collectives.wait, (start,), meta_like((world * sum(sizes),), val))
        grid = _call(step, aten.view.default, (flat, [world, sum(sizes)]), meta_like((world, sum(sizes)), val))
        offset = 0
        for old, n in zip(starts, sizes):
            rows = _call(step, aten.slice.Tensor, (grid, 1, offset, offset + n), None)
            whole = _call(step, aten.clone.default, (rows,), meta_like((world, n), val),
                          {"memory_format": torch.contiguous_format})
            weight = _call(step, aten.view.default, (whole, [-1]), meta_like((world * n,), val))
            _wait_of(old).replace_all_uses_with(weight)
            offset += n
    for old in starts:
        step.graph.erase_node(_wait_of(old))
        step.graph.erase_node(old)


def bucket(step: Step, cap_bytes: int) -> Step:
    """Merge neighbouring reduce-scatters, and neighbouring all-gathers, into buckets of at most cap_bytes."""
    for group in neighbours(step, collectives.reduce_scatter_start, cap_bytes):
        merge_reduce_scatters(step, group)
    for group in neighbours(step, collectives.all_gather_start, cap_bytes):
        merge_all_gathers(step, group)
    return step.recompile()
