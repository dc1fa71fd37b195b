"""The engines' bitwise mode on flat buckets: the parts that do not depend on an engine.

zl.SingleProcess, zl.DDP and zl.ZeRO(stage=1 | 2 | 3) take bitwise=True (zerolab.engines.options
says the contract). There each backward is one chunk of the global batch, and its gradient,
bucket by bucket, is one leaf of the fixed tree; the step adds the leaves across ranks:

    ChunkTrees          one open-ended TreeAccumulator per bucket: leaf k is this rank's k-th
                        backward since the last step (its chunk is global chunk r*K + k)
    agree_backwards     every rank ran the same power-of-two number K of backwards (refused by
                        name otherwise, before any collective that could hang), and which
                        parameters no backward on any rank reached: one small all-reduce
    reduce_buckets      the top of the tree across ranks, bucket by bucket, in bucket order:
                        whole (tree_all_reduce: DDP) or this rank's shard (tree_reduce_scatter:
                        ZeRO), then divided by N (a power of two: exact)
    check_same_threads  every rank computes with the same number of intra-op threads
"""

from __future__ import annotations

import torch

from .chunks import is_power_of_two
from .tree import TreeAccumulator, tree_all_reduce, tree_reduce_scatter
from .trainer import NORM_BLOCK, check_elementwise_optimizer

__all__ = ["NORM_BLOCK", "ChunkTrees", "agree_backwards", "reduce_buckets",
           "check_same_threads", "check_elementwise_optimizer", "quantum"]


def quantum(world_size: int, block: int = NORM_BLOCK) -> int:
    """What each bucket is padded to a multiple of: N * block, so every shard starts on the same
    alignment (the elementwise kernels' vector lanes line up on every N)."""
    return world_size * block


class ChunkTrees:
    """One TreeAccumulator per bucket, open-ended: the step learns how many backwards it had."""

    def __init__(self, buckets: int):
        self.buckets = buckets
        self.reset()

    def reset(self) -> None:
        self.trees = [TreeAccumulator() for _ in range(self.buckets)]

    @property
    def backwards(self) -> int:
        return self.trees[0].added

    def add(self, leaves: list) -> None:
        """One backward's fp32 gradient per bucket (each becomes the tree's own)."""
        for tree, leaf in zip(self.trees, leaves):
            tree.add(leaf)

    def held(self) -> list:
        """The partial sums the trees hold now (for memory reports)."""
        return [node for tree in self.trees for node in tree.partial_sums()]

    def roots(self) -> list:
        """Each bucket's sum over this rank's backwards, in the tree; the trees start again."""
        roots = [t.result() for t in self.trees]
        self.reset()
        return roots


def agree_backwards(backwards: int, reached: list, ledger, world_size: int) -> set:
    """Refuse unless every rank ran the same power-of-two number of backwards since the last step;
    return the positions of the parameters no rank's backward reached (they keep no gradient).
    One all-reduce (max) of [K, -K, reached flags...]: every rank gets the same verdict."""
    flags = torch.tensor([backwards, -backwards] + [float(r) for r in reached], dtype=torch.float64)
    if world_size > 1:
        ledger.all_reduce(flags, op="max", tag="bitwise:backwards")
    most, fewest = int(flags[0]), -int(flags[1])
    if most != fewest:
        raise ValueError(f"bitwise=True: the ranks ran between {fewest} and {most} backwards before this "
                         f"step; every rank must run the same number K of backwards (one chunk each) "
                         f"between two steps")
    if not is_power_of_two(most):
        raise ValueError(f"bitwise=True: {most} backwards before this step; the number of backwards per "
                         f"step on each rank (K, its chunks) must be a power of two (1, 2, 4, ...), so that "
                         f"the chunks are added in one perfect binary tree")
    return set((flags[2:] == 0).nonzero().flatten().tolist())


def reduce_buckets(roots: list, ledger, world_size: int, sharded: bool) -> list:
    """The fixed tree's top levels across ranks, bucket by bucket in bucket order, divided by N:
    each bucket's mean gradient, whole (sharded=False) or this rank's shard (sharded=True)."""
    out = []
    for root in roots:
        total = (tree_reduce_scatter if sharded else tree_all_reduce)(root, ledger)
        if world_size > 1:
            total.div_(world_size)          # a power of two: exact
        out.append(total)
    return out


def check_same_threads(ledger) -> None:
    """Refuse ranks that compute with different numbers of intra-op threads: a CPU matmul splits
    its work by thread, so a chunk's gradient would depend on which rank computes it."""
    threads = torch.tensor([torch.get_num_threads(), -torch.get_num_threads()])
    ledger.all_reduce(threads, op="max", tag="bitwise:setup")
    if threads[0] != -threads[1]:
        raise ValueError(f"bitwise=True: the ranks compute with between {-int(threads[1])} and "
                         f"{int(threads[0])} threads; give every rank the same torch.set_num_threads")
