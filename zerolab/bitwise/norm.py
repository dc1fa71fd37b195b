"""A fixed-order squared norm, for global-norm clipping that is the same bits on any N.

torch.nn.utils.clip_grad_norm_ adds per-parameter norms, a sharded engine adds per-shard
squares across ranks: both orders change with the layout, so the clip coefficient (and through
it every weight) changes in its last bits with the world size. Here the squares are added in
fixed blocks of `block` elements of the flat vector (blocks never straddle a shard: shards hold
whole blocks, zerolab.bitwise.flat), each block in a fixed tree, and the block sums in a fixed
tree over block indices. A rank holding a shard computes its blocks' sums and gathers the
others' (a concatenation: nothing is added in transit).

Zero padding changes nothing: the tree over block sums is padded to a power of two with +0,
and a subtree of zeros adds +0, so 1 rank (fewer padding blocks) and 8 ranks (more) agree.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .chunks import is_power_of_two


def halving_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum along the last dimension in a fixed tree: element i is added to element i + half,
    halving until one is left; a length that is not a power of two is padded with zeros first."""
    length = values.shape[-1]
    width = 1
    while width < length:
        width *= 2
    if width != length:
        values = torch.cat([values, values.new_zeros(*values.shape[:-1], width - length)], dim=-1)
    while values.shape[-1] > 1:
        half = values.shape[-1] // 2
        values = values[..., :half] + values[..., half:]
    return values[..., 0]


def block_sums_of_squares(x: torch.Tensor, block: int) -> torch.Tensor:
    """The sum of squares of each `block`-element block of a flat vector, each in a fixed tree."""
    if not is_power_of_two(block) or x.dim() != 1 or x.numel() % block:
        raise ValueError(f"block_sums_of_squares: needs a flat vector of whole {block}-element blocks "
                         f"(block a power of two), got {x.numel()} elements")
    x = x.float()
    return halving_sum((x * x).view(-1, block))


def fixed_order_sum_of_squares(x: torch.Tensor, block: int, ledger=None, sharded: bool = False,
                               group=None) -> torch.Tensor:
    """The squared norm of the whole flat vector (a 0-d fp32 tensor), the same bits on any N.

    x: the whole padded flat vector (sharded=False), or this rank's shard of it (sharded=True,
    then the ledger gathers every rank's block sums, in rank order, which is block order).
    """
    sums = block_sums_of_squares(x, block)
    if sharded and dist.is_initialized() and dist.get_world_size(group) > 1:
        every = torch.empty(sums.numel() * dist.get_world_size(group), dtype=sums.dtype)
        ledger.all_gather(every, sums, group=group, tag="bitwise:norm")
        sums = every
    return halving_sum(sums)


def clip_coefficient(sum_of_squares: torch.Tensor, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_'s coefficient, min(1, max_norm / (norm + 1e-6)), from the
    fixed-order squared norm: elementwise arithmetic on one number, so the same bits everywhere."""
    total = sum_of_squares.sqrt()
    return (max_norm / (total + 1e-6)).clamp(max=1.0)
