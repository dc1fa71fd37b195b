"""One fixed binary tree that adds the C chunk gradients, whatever rank holds them.

The tree is the perfect binary tree over chunk indices 0..C-1: leaves are chunks, and each
inner node is `left + right` of its two children. Every element of the result is therefore
formed by the same additions of the same operands, on 1 rank or on N.

Inside a rank: its C/N contiguous chunks are one subtree. TreeAccumulator adds them as they
arrive (a micro-batch at a time, for gradient accumulation) in exactly that subtree's shape,
keeping at most log2(C/N) + 1 partial sums.

Across ranks: rank r's subtree sum is leaf r of the top of the tree. Recursive halving pairs
ranks along that top: first ranks r and r^1 (siblings), then r and r^2 (the sums of pairs),
then r and r^4, ... At each level each rank of a pair keeps half of the elements it still
holds and sends the other half to its partner, who adds it to its own. The partner's
operand is the sum over the sibling subtree, so each partial sum has the same two operands as
on one process. (IEEE addition is commutative, so which side of `+` a partner sits on cannot
change a bit; only the grouping can, and the grouping is the tree's.)

Which half a rank keeps is chosen so that, after log2 N levels, rank r holds shard r of the
flat vector (shard r: the r-th of N equal contiguous slices), the layout ZeRO needs. That makes
the halves strided sets of shards rather than contiguous halves: at level k, rank r holds the
shards j with j = r (mod 2^k) and keeps those whose bit k matches its own. The bytes are those
of the ring's reduce-scatter, (N-1)/N of the vector per rank, in log2 N rounds instead of N-1.

Why point-to-point (isend/irecv) and not gloo's reduce-scatter: a library collective chooses
its own order of addition (a ring, or another algorithm, depending on the size and the
backend), so it would fix the order only by accident. Here the network only MOVES bits; every
addition is a local torch.add of two whole tensors, elementwise, in an order written down here.
The all-gather that follows adds nothing: it only concatenates the shards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .chunks import is_power_of_two


def tree_sum(tensors: list) -> torch.Tensor:
    """The perfect binary tree sum of a power-of-two number of tensors: the reference."""
    if not is_power_of_two(len(tensors)):
        raise ValueError(f"tree_sum: needs a power-of-two number of tensors, got {len(tensors)}")
    if len(tensors) == 1:
        return tensors[0].clone()
    half = len(tensors) // 2
    return tree_sum(tensors[:half]) + tree_sum(tensors[half:])


class TreeAccumulator:
    """Adds `count` tensors (count: a power of two), fed in index order, in the perfect binary tree.

    Like a binary counter: a new leaf is merged with the subtree on top of the stack while that
    subtree has the same size, so a node is formed as soon as both its children exist.
    count=None leaves the number open until result() (the engines' bitwise mode: a rank learns
    how many backwards a step had only at the step); a power of two of them is one tree.
    """

    def __init__(self, count: int | None = None):
        if count is not None and not is_power_of_two(count):
            raise ValueError(f"TreeAccumulator: count must be a power of two, got {count!r}")
        self.count = count
        self.added = 0
        self._stack: list = []      # (leaves under it, partial sum), oldest (leftmost) first

    def add(self, leaf: torch.Tensor) -> None:
        """Add the next leaf (it becomes the accumulator's own: it may be overwritten)."""
        if self.added == self.count:
            raise RuntimeError(f"TreeAccumulator: all {self.count} leaves were already added")
        size, node = 1, leaf
        while self._stack and self._stack[-1][0] == size:
            _, left = self._stack.pop()
            node = left.add_(node)          # left + right, in place in the left's buffer
            size *= 2
        self._stack.append((size, node))
        self.added += 1

    def partial_sums(self) -> list:
        """The subtrees' sums held now (at most log2(count) + 1 of them)."""
        return [node for _, node in self._stack]

    def result(self) -> torch.Tensor:
        """The root: the tree sum of all `count` leaves (count=None: of the leaves added, which
        must be a power of two of them)."""
        if self.count is None and not is_power_of_two(self.added):
            raise RuntimeError(f"TreeAccumulator: {self.added} leaves added, not a power of two: they "
                               f"are not one perfect binary tree")
        if self.count is not None and self.added != self.count:
            raise RuntimeError(f"TreeAccumulator: {self.added} of {self.count} leaves added; the tree "
                               f"is incomplete (every rank must feed all of its chunks before the step)")
        return self._stack[0][1]


def _group_rank_and_size(group):
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _global_rank(group, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def tree_reduce_scatter(local: torch.Tensor, ledger, group=None) -> torch.Tensor:
    """Shard r (of N equal contiguous shards) of the fixed-tree sum of every rank's `local`,
    where `local` is this rank's subtree sum and ranks are the tree's leaves in rank order.

    Bitwise equal to the same shard of tree_sum over all C chunks on one process.
    """
    r, n = _group_rank_and_size(group)
    if not is_power_of_two(n):
        raise ValueError(f"tree_reduce_scatter: the group size must be a power of two, got {n}")
    if local.dim() != 1 or local.numel() % n:
        raise ValueError(f"tree_reduce_scatter: needs a flat vector whose length ({local.numel()}) "
                         f"the group size ({n}) divides")
    shard = local.numel() // n
    held = local.view(n, shard)         # row i: shard (r mod d) + i*d, a partial sum over d ranks
    d = 1
    while d < n:
        mine = (r // d) & 1             # bit k of this rank = bit k of the shards it keeps
        pairs = held.view(-1, 2, shard)     # row i of held is pair i // 2, member i % 2 (bit k)
        keep, give = pairs[:, mine], pairs[:, 1 - mine].contiguous()
        incoming = torch.empty_like(give)
        partner = _global_rank(group, r ^ d)
        sent = ledger.isend(give, partner, group=group, tag="bitwise:tree")
        got = ledger.irecv(incoming, partner, group=group, tag="bitwise:tree")
        sent.wait()
        got.wait()
        # the left child is the lower block of ranks: the same grouping as the one-process tree
        held = keep + incoming if mine == 0 else incoming + keep
        d *= 2
    return held.reshape(shard)


def tree_all_reduce(local: torch.Tensor, ledger, group=None) -> torch.Tensor:
    """The whole fixed-tree sum on every rank: tree_reduce_scatter, then an all-gather that only
    concatenates the shards (rank r's at position r)."""
    _, n = _group_rank_and_size(group)
    mine = tree_reduce_scatter(local, ledger, group)
    if n == 1:
        return mine
    full = torch.empty(local.numel(), dtype=local.dtype)
    ledger.all_gather(full, mine, group=group, tag="bitwise:gather")
    return full
