"""Lab 8's planted mistakes: the library's shard and prefetch passes with one thing wrong, as
students write them. Each must fail the grader with the failure named in `expect`."""

from __future__ import annotations

from ..compiled.nodes import is_compute, last_use, positions
from ..compiled.shard import free_after, gather_before, views_per_region
from .lab import Mistake


def _regions(step, param):
    pos = positions(step.graph)
    loss_at = pos[step.loss_node()]
    readers = list(param.users)
    return pos, [r for r in (
        [u for u in readers if pos[u] <= loss_at], [u for u in readers if pos[u] > loss_at]) if r]


def gathers_after_first_use(step, world):
    views_per_region(step)
    for param in step.params():
        pos, regions = _regions(step, param)
        for region in regions:
            first = min(region, key=pos.__getitem__)
            weight = gather_before(step, param, first.next, world)     # (after the first reader)
            for user in region:
                user.replace_input_with(param, weight)
            free_after(step, weight, last_use(weight, positions(step.graph)))
    return step


def frees_after_first_reader(step, world):
    views_per_region(step)
    for param in step.params():
        pos, regions = _regions(step, param)
        for region in regions:
            weight = gather_before(step, param, min(region, key=pos.__getitem__), world)
            for user in region:
                user.replace_input_with(param, weight)
            pos = positions(step.graph)
            free_after(step, weight, min(weight.users, key=pos.__getitem__))   # (the first reader)
    return step


def never_frees(step, world):
    views_per_region(step)
    for param in step.params():
        pos, regions = _regions(step, param)
        for region in regions:
            weight = gather_before(step, param, min(region, key=pos.__getitem__), world)
            for user in region:
                user.replace_input_with(param, weight)      # (and no free)
    return step


def gathers_once(step, world):
    views_per_region(step)
    for param in step.params():
        pos = positions(step.graph)
        readers = list(param.users)                          # (forward and backward together)
        weight = gather_before(step, param, min(readers, key=pos.__getitem__), world)
        for user in readers:
            user.replace_input_with(param, weight)
        free_after(step, weight, last_use(weight, positions(step.graph)))
    return step


def gathers_forward_only(step, world):
    views_per_region(step)
    for param in step.params():
        pos, regions = _regions(step, param)
        region = regions[0]                                   # (the backward's readers are left alone)
        weight = gather_before(step, param, min(region, key=pos.__getitem__), world)
        for user in region:
            user.replace_input_with(param, weight)
        free_after(step, weight, last_use(weight, positions(step.graph)))
    return step


def _starts(step):
    from ..compiled import collectives
    return [n for n in step.graph.nodes if n.target is collectives.all_gather_start]


def prefetch_past_the_top(step, depth):
    for start in _starts(step):
        before, seen, node = start, 0, start.prev
        while seen < depth:                                   # (no stop at the top of the program)
            if is_compute(node):
                seen, before = seen + 1, node
            node = node.prev
        before.prepend(start)
    return step


def moves_the_wait(step, depth):
    for start in _starts(step):
        wait = next(iter(start.users))
        before, seen, node = start, 0, start.prev
        while seen < depth and node.op not in ("root", "placeholder") and node not in start.all_input_nodes:
            if is_compute(node):
                seen, before = seen + 1, node
            node = node.prev
        if before is not start:
            before.prepend(start)
            start.append(wait)                                # (the wait goes up with it)
    return step


def counts_every_node(step, depth):
    for start in _starts(step):
        before, seen, node = start, 0, start.prev
        while seen < depth and node.op not in ("root", "placeholder") and node not in start.all_input_nodes:
            seen, before = seen + 1, node                     # (a view counts as an operation)
            node = node.prev
        before.prepend(start)
    return step


MISTAKES = (
    Mistake("gathers_after_first_use", "inserts each all-gather after the region's first reader",
            {"shard": gathers_after_first_use}, "gather_after_first_use"),
    Mistake("frees_after_first_reader", "frees each gathered weight after its first reader, not its last",
            {"shard": frees_after_first_reader}, "free_before_last_use"),
    Mistake("never_frees", "gathers each weight but never frees it", {"shard": never_frees}, "not_freed"),
    Mistake("gathers_once", "gathers each weight once, for the forward and the backward together",
            {"shard": gathers_once}, "kept_across_gap"),
    Mistake("gathers_forward_only", "gathers each weight for the forward only", {"shard": gathers_forward_only},
            "reads_shard"),
    Mistake("prefetch_past_the_top", "walks up past the top of the program, where there is room for fewer than "
            "depth operations", {"prefetch": prefetch_past_the_top}, "prefetch_breaks_dependency"),
    Mistake("moves_the_wait", "moves the wait up with the start", {"prefetch": moves_the_wait}, "wait_moved"),
    Mistake("counts_every_node", "counts views and waits as operations", {"prefetch": counts_every_node},
            "prefetch_depth"),
)
