"""Pass (d), prefetch: each all-gather starts `depth` operations before it used to.

The gather's wait stays where it was, just before the weight is read; only its start moves
up, past `depth` operations that do work (views and collectives do not count). The ranks'
links then move the weight while those operations compute. The price is memory: the
gathered buffer exists from its start, `depth` operations sooner.

A start may not move above what it reads (the shard, or a bucket's concatenation of shards).
"""

from __future__ import annotations

from . import collectives
from .capture import Step
from .nodes import is_compute


def prefetch(step: Step, depth: int) -> Step:
    for start in [n for n in step.graph.nodes if n.target is collectives.all_gather_start]:
        before, seen, node = start, 0, start.prev
        while seen < depth and node.op not in ("root", "placeholder") and node not in start.all_input_nodes:
            if is_compute(node):
                seen, before = seen + 1, node
            node = node.prev
        before.prepend(start)
    return step.recompile()
