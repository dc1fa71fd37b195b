"""Lab 8: ZeRO-3 as passes over a captured step: the shard pass and the prefetch pass (chapter 16).

Write the two functions below. Each receives a training step captured by make_fx
(zerolab.compiled.capture.Step: step.graph, step.params(), step.loss_node()) and rewrites its graph
in place; return the step. The grader checks the graph the moment each returns, runs the library's
reduce pass between them, and trains the result on 2 ranks against eager zl.ZeRO(stage=3).
Stuck? The lab's notebook has hints, folded: open one at a time.

    python -m zerolab.labs grade compiled labs/lab8_compiled.py

What you may use (all in zerolab.compiled):
    positions(graph)                  node -> its index in the program
    views_of(node), last_use(node, pos)   a value and its views; the last node that reads any of them
    is_compute(node)                  an aten operation that does work (not a view, not a collective)
    views_per_region(step)            gives the backward its own copies of the forward's views of weights
    gather_before(step, param, node, world) -> weight   an all-gather of param's shard, its wait and a
                                      view to the full shape, inserted just before `node`
    free_after(step, weight, node)    a free of `weight` inserted just after `node`
    collectives.all_gather_start      the target of every all-gather's start node
"""

from zerolab.compiled import collectives  # noqa: F401  (the target of the starts prefetch moves)
from zerolab.compiled.nodes import is_compute, last_use, positions, views_of  # noqa: F401
from zerolab.compiled.shard import free_after, gather_before, views_per_region  # noqa: F401


def shard(step, world):
    """Every parameter placeholder becomes this rank's 1/world shard.

    Must: call views_per_region(step) first. Then, for each parameter in step.params(), split its
    readers (param.users) into the forward's (at or before step.loss_node()) and the backward's. In
    each region that has readers: gather just before the region's FIRST reader, hand the gathered
    weight to EVERY reader of the region, and free it just after its LAST reader (of the weight or any
    view of it). Positions change as you insert: recompute them when you need them."""
    raise NotImplementedError("shard")


def prefetch(step, depth):
    """Each all-gather's start moves `depth` operations earlier.

    Must: for each start node (node.target is collectives.all_gather_start), walk up from it,
    counting only nodes for which is_compute(node) is true, and put the start just before the
    depth-th such node. Never move it above a placeholder or a node it reads (start.all_input_nodes).
    The wait stays where it is."""
    raise NotImplementedError("prefetch")
