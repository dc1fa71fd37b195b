"""A two-dimensional mesh of ranks: data parallel (dp) x model parallel (mp).

    mesh = zl.Mesh(dp=2, mp=2)      # 4 ranks

Layout (as in Megatron-LM): the ranks of one model-parallel group are consecutive, because
tensor parallelism talks after every layer and wants the fastest links (one node):

    rank = dp_rank * mp + mp_rank

    mp groups (split each layer):      [0, 1]   [2, 3]
    dp groups (same shard, other data): [0, 2]   [1, 3]

ZeRO shards model states over the dp group only; tensor parallelism and ZeRO-R's
partitioned activations talk inside the mp group.
"""

from __future__ import annotations

import torch.distributed as dist

from ..runtime.comm import Ledger


class Mesh:
    """Process groups for data and model parallelism over the launched ranks."""

    def __init__(self, dp: int | None = None, mp: int = 1, ledger: Ledger | None = None):
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        if isinstance(mp, bool) or not isinstance(mp, int) or mp < 1:
            raise ValueError(f"Mesh: mp must be an int >= 1, got {mp!r}")
        if world % mp:
            raise ValueError(f"Mesh: mp={mp} does not divide the world size {world}; choose mp from "
                             f"{[d for d in range(1, world + 1) if world % d == 0]}")
        if dp is None:
            dp = world // mp
        if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1 or dp * mp != world:
            raise ValueError(f"Mesh: dp x mp must equal the world size: dp={dp!r}, mp={mp}, "
                             f"world size {world}")
        self.dp, self.mp, self.world_size, self.rank = dp, mp, world, rank
        self.dp_rank, self.mp_rank = divmod(rank, mp)
        self.mp_ranks = [self.dp_rank * mp + i for i in range(mp)]
        self.dp_ranks = [i * mp + self.mp_rank for i in range(dp)]
        self.ledger = ledger if ledger is not None else Ledger()
        # Every rank must create every group, in the same order, even groups it is not in.
        self.mp_group = self.dp_group = None
        if dist.is_initialized():
            for d in range(dp):
                g = dist.new_group([d * mp + i for i in range(mp)])
                if d == self.dp_rank:
                    self.mp_group = g
            for m in range(mp):
                g = dist.new_group([i * mp + m for i in range(dp)])
                if m == self.mp_rank:
                    self.dp_group = g

    def __repr__(self):
        return (f"Mesh(dp={self.dp}, mp={self.mp}; rank {self.rank} = dp_rank {self.dp_rank}, "
                f"mp_rank {self.mp_rank}; mp group {self.mp_ranks}, dp group {self.dp_ranks})")
