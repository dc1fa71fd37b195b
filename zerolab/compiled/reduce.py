"""Pass (b), reduce: each gradient is reduce-scattered, so a rank keeps only its shard of it.

Where the reduce-scatter goes is the difference between ZeRO-1 and ZeRO-2:
at="produced" launches it right after the backward computes the gradient, so the full
gradient dies at once (ZeRO-2); at="end" waits for the whole backward (ZeRO-1 keeps every
full gradient until then). The step then returns gradient shards instead of gradients.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from . import collectives
from .capture import Step
from .nodes import meta_like

aten = torch.ops.aten


def reduce_scatter_after(step: Step, grad: fx.Node, anchor: fx.Node, world: int) -> fx.Node:
    """flatten (copying only when the gradient is not contiguous), reduce-scatter, wait."""
    val = grad.meta["val"]
    with step.graph.inserting_before(anchor.next):   # (inserting_after would reverse them)
        flat = grad
        if not val.is_contiguous():
            flat = step.graph.call_function(aten.clone.default, (grad,), {"memory_format": torch.contiguous_format})
            flat.meta["val"] = meta_like(val.shape, val)
        flat = step.graph.call_function(aten.view.default, (flat, [-1]))
        start = step.graph.call_function(collectives.reduce_scatter_start, (flat, world))
        shard = step.graph.call_function(collectives.wait, (start,))
    flat.meta["val"] = meta_like((val.numel(),), val)
    shard.meta["val"] = meta_like((val.numel() // world,), val)
    return shard


def reduce(step: Step, world: int, at: str = "produced") -> Step:
    """Each gradient the step returns becomes this rank's mean shard of it."""
    if at not in ("produced", "end"):
        raise ValueError(f"at must be 'produced' (ZeRO-2) or 'end' (ZeRO-1), not {at!r}")
    output = step.graph.output_node()
    loss, *grads = output.args[0]
    shards = []
    for grad in grads:
        anchor = grad if at == "produced" else output.prev
        shards.append(reduce_scatter_after(step, grad, anchor, world))
    output.args = ((loss, *shards),)
    return step.recompile()
