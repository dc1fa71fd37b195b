"""Where the ranks sit: nodes of `ranks_per_node` ranks, and which links a collective uses.

    topo = zl.Topology(ranks_per_node=2)      # 4 ranks = 2 nodes x 2 ranks

A cluster has two kinds of links (chapter 4's cost model): fast ones INSIDE a node (NVLink,
~450 GB/s per GPU) and slow ones ACROSS nodes (InfiniBand, ~50 GB/s per GPU). ZeRO++ and HSDP
are about keeping bytes off the slow links, so the ledger books every byte this rank sends by
the link it crosses (Ledger.topology = topo). The layout is torchrun's: consecutive ranks share
a node.

    node = rank // ranks_per_node          local_rank = rank % ranks_per_node

    node groups  (one per node):             [0, 1]   [2, 3]
    cross groups (one per local rank):       [0, 2]   [1, 3]

On one machine the nodes are pretend nodes: nothing is slower, but every byte is still booked
where it WOULD travel on a real cluster, which is what the closed forms are about.

Default (topology=None in an engine): $LOCAL_WORLD_SIZE ranks per node, which torchrun sets to
the ranks on each machine (zl.launch to the whole world: one node).
"""

from __future__ import annotations

import os

import torch.distributed as dist


class Topology:
    """Node and cross-node process groups over the launched ranks."""

    def __init__(self, ranks_per_node: int | None = None):
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        if ranks_per_node is None:
            ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
            raise ValueError(f"Topology: ranks_per_node must be an int >= 1, got {ranks_per_node!r}")
        if world % ranks_per_node:
            raise ValueError(f"Topology: ranks_per_node={ranks_per_node} does not divide the world size "
                             f"{world}: every node must hold the same number of ranks; choose one of "
                             f"{[d for d in range(1, world + 1) if world % d == 0]}")
        g = ranks_per_node
        self.ranks_per_node, self.nodes, self.world_size, self.rank = g, world // g, world, rank
        self.node, self.local_rank = divmod(rank, g)
        self.node_ranks = [self.node * g + i for i in range(g)]
        self.cross_ranks = [n * g + self.local_rank for n in range(self.nodes)]
        # Every rank must create every group, in the same order, even groups it is not in.
        self.node_group = self.cross_group = None
        if dist.is_initialized() and world > 1:
            for n in range(self.nodes):
                grp = dist.new_group([n * g + i for i in range(g)])
                if n == self.node:
                    self.node_group = grp
            for i in range(g):
                grp = dist.new_group([n * g + i for n in range(self.nodes)])
                if i == self.local_rank:
                    self.cross_group = grp

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def link(self, src: int, dst: int) -> str:
        """'intra' if the two ranks share a node, else 'inter'."""
        return "intra" if self.node_of(src) == self.node_of(dst) else "inter"

    def __repr__(self):
        return (f"Topology({self.nodes} nodes x {self.ranks_per_node} ranks; rank {self.rank} = node "
                f"{self.node}, local rank {self.local_rank})")


def as_topology(topology) -> Topology:
    """An engine's topology= argument: a Topology, an int (ranks per node) or None (the default)."""
    if topology is None or isinstance(topology, int) and not isinstance(topology, bool):
        return Topology(topology)
    if isinstance(topology, Topology):
        return topology
    raise TypeError(f"topology must be a zl.Topology, an int (ranks per node) or None, got {topology!r}")
