"""Chapter 16's runs: the captured step, each pass's effect on it, and timings on ranks.

Graph facts (kinds of nodes, counts of collectives) need no ranks: the passes are static.
The workers (`timings`) run on ranks under zl.launch and return seconds per step.
"""

from __future__ import annotations

import operator
import statistics
import time
import warnings
from collections import OrderedDict

import torch

import zerolab as zl
from zerolab.compiled import collectives, runs
from zerolab.compiled.bucket import bucket
from zerolab.compiled.capture import capture, gpt_loss
from zerolab.compiled.nodes import is_view, positions
from zerolab.compiled.prefetch import prefetch
from zerolab.compiled.reduce import reduce
from zerolab.compiled.shard import shard
from zerolab.compiled.zero import Trainer

KINDS = ("input", "forward", "backward", "view", "all-gather", "reduce-scatter", "free")


def kinds(step) -> list:
    """One word per node, in program order: what the node is (KINDS)."""
    pos = positions(step.graph)
    loss_at = pos[step.loss_node()]
    out = []
    for node in step.graph.nodes:
        start = node.args[0] if node.target is collectives.wait else node
        if node.op in ("placeholder", "output"):
            out.append("input" if node.op == "placeholder" else None)
        elif start.target is collectives.all_gather_start:
            out.append("all-gather")
        elif start.target is collectives.reduce_scatter_start:
            out.append("reduce-scatter")
        elif node.target is collectives.free:
            out.append("free")
        elif is_view(node) or node.target is operator.getitem:
            out.append("view")
        else:
            out.append("forward" if pos[node] <= loss_at else "backward")
    return [k for k in out if k is not None]


def pass_by_pass(world: int = 4, cap_bytes: int = 1 << 16, depth: int = 2) -> dict:
    """The GPT's step after each pass of ZeRO-3: label -> {"kinds": one word per node,
    "all-gathers", "reduce-scatters", "frees": how many of each the step runs}."""
    step = capture(runs.tiny_gpt(), gpt_loss, runs.batch(0, 0, world))

    def seen():
        count = {f: sum(n.target is f for n in step.graph.nodes)
                 for f in (collectives.all_gather_start, collectives.reduce_scatter_start, collectives.free)}
        return {"kinds": kinds(step), "all-gathers": count[collectives.all_gather_start],
                "reduce-scatters": count[collectives.reduce_scatter_start], "frees": count[collectives.free]}
    out = {"captured": seen()}
    shard(step, world)
    out["+ shard"] = seen()
    reduce(step, world)
    out["+ reduce"] = seen()
    bucket(step, cap_bytes)
    out[f"+ bucket ({cap_bytes // 1024} KiB)"] = seen()
    prefetch(step, depth)
    out[f"+ prefetch ({depth})"] = seen()
    return out


def mlp_step():
    """A two-layer perceptron's step: small enough to draw every node and edge."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(OrderedDict(fc1=torch.nn.Linear(8, 16), relu=torch.nn.ReLU(), fc2=torch.nn.Linear(16, 4)))
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    return capture(model, lambda forward, x, y: torch.nn.functional.mse_loss(forward(x), y), (x, y))


def drawable(step) -> dict:
    """Nodes (name, kind) and edges (i, j) of a small step, for zerolab.book.compiled_plots.graph."""
    nodes = [n for n in step.graph.nodes if n.op != "output"]
    index = {n: i for i, n in enumerate(nodes)}
    labels = [n.name if n.op == "placeholder" else str(getattr(n.target, "__name__", n.target)).split(".")[0]
              for n in nodes]
    edges = [(index[a], index[n]) for n in nodes for a in n.all_input_nodes]
    return {"labels": labels, "kinds": kinds(step), "edges": edges}


def collectives_per_step(step) -> int:
    return sum(n.target in collectives.COLLECTIVE_STARTS for n in step.graph.nodes)


def timings(configs: list, steps: int = 6, warmup: int = 2) -> dict:
    """Seconds per step of each ZeRO-3 graph config (bucket_bytes, depth), and of eager zl.ZeRO-3.
    Every rank times its own steps; the slowest rank's time is a step's time."""
    rank, world = zl.rank(), zl.world_size()
    out = {}
    for config in configs:
        trainer = Trainer(runs.tiny_gpt(), runs.adamw(), gpt_loss, runs.batch(0, rank, world), 3,
                          zl.comm.Ledger(timeout=None), bucket_bytes=config[0], depth=config[1])
        out[config] = _time(lambda s: trainer.train_step(*runs.batch(s, rank, world)), steps, warmup)
        out[config, "collectives"] = collectives_per_step(trainer.step_graph)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = zl.ZeRO(runs.tiny_gpt(), runs.adamw(), stage=3)

    def eager(s):
        gpt_loss(engine, *runs.batch(s, rank, world)).backward()
        engine.optimizer.step()
        engine.optimizer.zero_grad()
    out["eager"] = _time(eager, steps, warmup)
    return out


def _time(one_step, steps, warmup) -> list:
    seconds = []
    for s in range(warmup + steps):
        torch.distributed.barrier()
        t = time.perf_counter()
        one_step(s)
        torch.distributed.barrier()
        seconds.append(time.perf_counter() - t)
    return seconds[warmup:]


def median_spread(xs) -> tuple:
    return statistics.median(xs), min(xs), max(xs)
