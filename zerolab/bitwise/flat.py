"""The trainable parameters as one flat, padded vector, cut into N equal shards.

The bitwise mode adds and updates gradients and weights as one flat vector (or this rank's
shard of it). Its length is padded with zeros to a multiple of N * block, so that every shard
starts at a multiple of `block` elements (the elementwise kernels' vector lanes line up the
same way on every N). The padding depends on N, but it changes no bit: it is zeros at the end, which the
elementwise sums and updates leave at zero and the norm's tree adds as +0.
"""

from __future__ import annotations

import torch

from .chunks import is_power_of_two


def trainable_parameters(model: torch.nn.Module) -> list:
    """The parameters that get gradients, each once (a tied weight is one parameter), in model order."""
    return [p for p in model.parameters() if p.requires_grad]


class FlatLayout:
    """Where each parameter lives in the flat vector, and the padded length and shards."""

    def __init__(self, params, world_size: int, block: int):
        if not is_power_of_two(block):
            raise ValueError(f"bitwise mode: the shards' alignment (block) must be a power of two, got {block!r}")
        self.params = list(params)
        self.shapes = [p.shape for p in self.params]
        self.numels = [p.numel() for p in self.params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.numels))]
        self.numel = sum(self.numels)
        self.world_size, self.block = world_size, block
        quantum = world_size * block
        self.padded = max(1, -(-self.numel // quantum)) * quantum
        self.shard_numel = self.padded // world_size

    def flatten(self, tensors, dtype=torch.float32) -> torch.Tensor:
        """One padded flat vector of `tensors` (one per parameter; None reads as zeros)."""
        flat = torch.zeros(self.padded, dtype=dtype)
        for t, off, n in zip(tensors, self.offsets, self.numels):
            if t is not None:
                flat[off:off + n].copy_(t.reshape(-1))      # a copy (and an exact cast up): no arithmetic
        return flat

    def shard(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s contiguous shard of a padded flat vector (a view)."""
        return flat[rank * self.shard_numel:(rank + 1) * self.shard_numel]

    def write_into_params(self, flat: torch.Tensor) -> None:
        """Copy the flat vector into the parameters (cast to their dtype: an elementwise rounding)."""
        with torch.no_grad():
            for p, off, n in zip(self.params, self.offsets, self.numels):
                p.copy_(flat[off:off + n].view(p.shape))
