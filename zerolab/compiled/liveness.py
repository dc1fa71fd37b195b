"""Pass (e), liveness: the step's peak memory, predicted from the graph alone.

Walk the program in order. A node that returns new memory allocates its bytes (read from
node.meta["val"]); a view allocates nothing and keeps its input's memory alive. Memory dies
right after the last node that reads it or any view of it, which is when the generated code
drops its last name. A collective's start keeps its input alive until its wait.

The result counts what the step allocates above what existed before it ran (parameters,
shards, the batch), as zerolab.memory.AllocationTracker measures it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from . import collectives
from .capture import Step
from .nodes import is_view, positions


@dataclass
class Timeline:
    peak: int                # the most bytes alive at once
    after_node: list         # bytes alive after each node (its allocations in, its frees out)
    at_node: list            # bytes alive while each node runs (before its frees)
    names: list              # the nodes' names, in order
    after_alloc: list        # bytes alive right after each allocation, in the order they happen


def measured_after_alloc(trace) -> list:
    """The same sequence from an AllocationTracker's trace (record_trace=True)."""
    alive, out = 0, []
    for event in trace:
        alive += event.delta
        if event.delta > 0:
            out.append(alive)
    return out


def _bytes(val) -> int:
    return val.untyped_storage().nbytes() if isinstance(val, torch.Tensor) else 0


def _new_memory(node: fx.Node) -> list:
    """The blocks of new memory `node` allocates: [(block, bytes)]."""
    if node.op != "call_function" or is_view(node) or node.target is operator.getitem:
        return []
    if node.target in collectives.COLLECTIVE_STARTS:
        val = node.args[0].meta["val"]
        world = node.args[1]
        n = val.numel() * world if node.target is collectives.all_gather_start else val.numel() // world
        return [(node, n * val.dtype.itemsize)]
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return [((node, i), _bytes(v)) for i, v in enumerate(val) if _bytes(v)]
    return [(node, _bytes(val))] if _bytes(val) else []


def blocks(graph: fx.Graph) -> tuple:
    """block -> bytes, and node -> the blocks its value keeps alive."""
    size, holds = {}, {}
    for node in graph.nodes:
        new = _new_memory(node)
        size.update(new)
        if new:
            holds[node] = {b for b, _ in new}
        elif node.op == "call_function" and node.target is operator.getitem and not is_view(node.args[0]):
            holds[node] = {(node.args[0], node.args[1])} & set(size)   # one result of a tuple
        elif is_view(node):
            holds[node] = set(holds.get(node.args[0], ()))
        else:
            holds[node] = set()
    return size, holds


def liveness(step: Step) -> Timeline:
    graph = step.graph
    pos = positions(graph)
    size, holds = blocks(graph)
    dies = {b: pos[n] for n in graph.nodes for b in holds[n]}     # born there at the latest
    for node in graph.nodes:
        for arg in node.all_input_nodes:
            for b in holds[arg]:
                dies[b] = max(dies[b], pos[node])
        if node.target is collectives.wait:          # the start's input lives until the wait
            for arg in node.args[0].all_input_nodes:
                for b in holds[arg]:
                    dies[b] = max(dies[b], pos[node])
    for arg in graph.output_node().all_input_nodes:
        for b in holds[arg]:
            dies[b] = len(pos)                       # returned: alive after the step
    alive, after_node, at_node, after_alloc = 0, [], [], []
    freed = {}
    for b, i in dies.items():
        freed.setdefault(i, []).append(b)
    for i, node in enumerate(graph.nodes):
        for b, nbytes in size.items():
            if b == node or (isinstance(b, tuple) and b[0] == node):
                alive += nbytes
                after_alloc.append(alive)
        at_node.append(alive)
        alive -= sum(size[b] for b in freed.get(i, ()))
        after_node.append(alive)
    return Timeline(max(at_node, default=0), after_node, at_node, [n.name for n in graph.nodes], after_alloc)
