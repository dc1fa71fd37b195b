"""What the passes need to know about a node: where it is, and whether it owns new memory.

An aten operation either returns new memory (addmm, cat, clone) or a view of its input
(view, t, transpose, split, detach): its schema says which. A view costs nothing, but it
keeps its input's memory alive. The passes and the liveness pass read these facts here.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from . import collectives

_ALSO_VIEWS = {torch.ops.aten._unsafe_view.default}   # shares its input's storage; the schema does not say so


def is_view(node: fx.Node) -> bool:
    """Does this node return a view of its first input (no new memory)?"""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:                       # an element of a list of views (split)
        return is_view(node.args[0])
    if node.target is collectives.wait:                        # the start's buffer, now complete
        return True
    if node.target in _ALSO_VIEWS:
        return True
    schema = getattr(node.target, "_schema", None)
    return schema is not None and bool(schema.returns) and all(r.alias_info is not None for r in schema.returns)


def is_compute(node: fx.Node) -> bool:
    """An aten operation that does work: not a placeholder, a view, an element of a tuple or a collective."""
    return (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
            and not is_view(node))


def positions(graph: fx.Graph) -> dict:
    """node -> its index in the program."""
    return {n: i for i, n in enumerate(graph.nodes)}


def views_of(node: fx.Node) -> list:
    """`node` and every view made from it, directly or through other views."""
    out, todo = [], [node]
    while todo:
        n = todo.pop()
        out.append(n)
        todo.extend(u for u in n.users if is_view(u) and u.args[0] is n)
    return out


def last_use(node: fx.Node, pos: dict) -> fx.Node:
    """The last node that reads `node` or any view of it."""
    readers = [u for v in views_of(node) for u in v.users] + views_of(node)
    return max(readers, key=pos.__getitem__)


def meta_like(shape, val) -> torch.Tensor:
    """A stand-in for a result's shape and dtype (node.meta['val']) on the meta device."""
    return torch.empty(shape, dtype=val.dtype, device="meta")
