"""bitwise=True on ZeRO-3 (engines.options.BITWISE): each unit's chunks go into the unit's tree.

In the default mode a unit's full gradient is reduce-scattered as soon as the unit's backward
ends. In the bitwise mode each backward is one chunk of the global batch (rank r's k-th backward
is chunk r*K + k), and a rank's K chunks are one subtree of the fixed tree: they must be added
on this rank before they meet any other rank's. So when a unit's backward ends, its full
gradient (cast to fp32) becomes the next leaf of the unit's TreeAccumulator; at the step the
trees cross ranks by recursive halving straight into this rank's shard (tree_reduce_scatter).

What that costs: between a backward and the step this rank holds each unit's full fp32 gradient
tree (log2 K + 1 partial sums at most), as zl.DDP holds its buckets. Parameters are still
gathered and freed unit by unit, and the optimizer state stays sharded; only the gradients'
sharding is given up, for the same bits at any world size.
"""

from __future__ import annotations

import torch

from ...bitwise import buckets as bitwise_buckets


class UnitChunks:
    """ZeRO-3's side of the bitwise mode (the shared side is engines.bitwise_mode.BitwiseMode)."""

    takes_bitwise = True

    def _start_chunk_trees(self) -> None:
        self._trees = bitwise_buckets.ChunkTrees(len(self._trained()))
        self._tree_of = {id(u): i for i, u in enumerate(self._trained())}
        self._chunks_ended, self._summed = 0, None

    def _add_unit_chunk(self, u) -> None:
        """The unit's backward of this chunk is over: its full gradient is the tree's next leaf."""
        self._trees.trees[self._tree_of[id(u)]].add(self._leaf(u, u.grad_full))
        u.grad_full = None

    def _end_chunk(self) -> None:
        """The backward is over: a unit it never reached gets a leaf of zeros (every tree has
        one leaf per chunk); p.grad holds placeholders until the step (engines.chunk_grad)."""
        self._chunks_ended += 1
        for u, tree in zip(self._trained(), self._trees.trees):
            if tree.added < self._chunks_ended:
                tree.add(self._leaf(u, None))
        self._hand_out_placeholders()

    @staticmethod
    def _leaf(u, grad) -> torch.Tensor:
        b = u.buckets["train"]
        if grad is None:
            return torch.zeros(b.padded_numel, dtype=torch.float32, device=u.master.device)
        return grad.to(torch.float32, copy=True)

    def _chunk_sum(self) -> list:
        """The step's gradient shard per unit: the trees across ranks into this rank's shard,
        divided by N (computed once per step; the clip's norm and the step share it)."""
        if self._summed is None:
            bitwise_buckets.agree_backwards(self._chunks_ended, [], self.comm, self.world_size)
            roots = self._trees.roots()
            self._chunks_ended = 0
            self._summed = bitwise_buckets.reduce_buckets(roots, self.comm, self.world_size, sharded=True)
            for u, shard in zip(self._trained(), self._summed):
                u.grad_shard = shard
        return self._summed

    def _forget_chunks(self) -> None:
        """zero_grad(): the chunks added since the last step go."""
        self._trees.reset()
        self._chunks_ended, self._summed = 0, None
