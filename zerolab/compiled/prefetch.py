"""Pass (d), prefetch: each all-gather starts `depth` operations before it used to.

The gather's wait stays where it was, just before the weight is read; only its start moves
up, past `depth` operations that do work (views and collectives do not count). The ranks'
links then move the weight while those operations compute. The price is memory: the
gathered buffer exists from its start, `depth` operations sooner.

A start may not move above what it reads. A bucket's concatenation of shards reads only
the shards, which exist from the beginning, so it moves up with its start.
"""

from __future__ import annotations

import torch

from . import collectives
from .capture import Step
from .nodes import is_compute


def _moves_with(start) -> list:
    """What moves up with a start: a bucket's concatenation of shards, then the start."""
    (what,) = start.args[:1]
    if what.target is torch.ops.aten.cat.default and all(n.op == "placeholder" for n in what.all_input_nodes):
        return [what, start]
    return [start]


def prefetch(step: Step, depth: int) -> Step:
    for start in [n for n in step.graph.nodes if n.target is collectives.all_gather_start]:
        moving = _moves_with(start)
        before, seen, node = moving[0], 0, moving[0].prev
        while seen < depth and node.op not in ("root", "placeholder") and node not in moving[0].all_input_nodes:
            if is_compute(node):
                seen, before = seen + 1, node
            node = node.prev
        for n in moving:
            before.prepend(n)
    return step.recompile()
