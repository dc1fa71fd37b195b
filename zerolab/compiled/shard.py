"""Pass (a), ZeRO-3's shard: parameters arrive as shards, gathered just before use, freed after.

The forward and the backward are two regions of the same program. In each region that reads
a parameter, the pass inserts an all-gather before the first read and a free after the last.
So the full weight never lives across the gap between forward and backward: the backward
gathers it again, as eager ZeRO-3 does.

A view of a weight made in the forward (its transpose, say) can be read again by the
backward. Views cost nothing to remake, so `views_per_region` first gives the backward its own.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from . import collectives
from .capture import Step
from .nodes import is_view, last_use, meta_like, positions

aten = torch.ops.aten


def views_per_region(step: Step) -> None:
    """Each backward read of a forward view of a parameter reads a fresh copy of that view."""
    params = set(step.params())
    pos = positions(step.graph)
    loss_at = pos[step.loss_node()]

    def from_param(n):          # a view of a view ... of a parameter
        return n in params or (is_view(n) and from_param(n.args[0]))

    def remake(n):
        return n if n in params else step.graph.node_copy(n, remake)

    for user in [n for n in step.graph.nodes if pos[n] > loss_at]:
        for arg in user.all_input_nodes:
            if arg not in params and pos[arg] <= loss_at and from_param(arg):
                with step.graph.inserting_before(user):
                    user.replace_input_with(arg, remake(arg))


def gather_before(step: Step, param: fx.Node, first: fx.Node, world: int) -> fx.Node:
    """all-gather + wait + view to the full shape, inserted just before `first`."""
    full = param.meta.setdefault("full", param.meta["val"])
    param.meta["val"] = meta_like((full.numel() // world,), full)     # the placeholder is now a shard
    with step.graph.inserting_before(first):
        start = step.graph.call_function(collectives.all_gather_start, (param, world))
        flat = step.graph.call_function(collectives.wait, (start,))
        weight = step.graph.call_function(aten.view.default, (flat, list(full.shape)))
    flat.meta["val"] = meta_like((full.numel(),), full)
    weight.meta["val"] = meta_like(full.shape, full)
    return weight


def free_after(step: Step, weight: fx.Node, reader: fx.Node) -> None:
    """A free of the gathered weight right after `reader`."""
    with step.graph.inserting_after(reader):
        step.graph.call_function(collectives.free, (weight,))


def shard(step: Step, world: int) -> Step:
    """Every parameter placeholder becomes this rank's 1/world shard of it."""
    views_per_region(step)
    pos = positions(step.graph)
    loss_at = pos[step.loss_node()]
    for param in step.params():
        full = param.meta.setdefault("full", param.meta["val"])
        if full.numel() % world:
            raise ValueError(f"{param.name}: {full.numel()} elements do not split into {world} equal shards")
        readers = list(param.users)
        for region in ([u for u in readers if pos[u] <= loss_at], [u for u in readers if pos[u] > loss_at]):
            if region:
                weight = gather_before(step, param, min(region, key=pos.__getitem__), world)
                for user in region:
                    user.replace_input_with(param, weight)
                free_after(step, weight, last_use(weight, positions(step.graph)))
    return step.recompile()
