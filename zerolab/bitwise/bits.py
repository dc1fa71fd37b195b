"""How many bits two sets of weights differ in: the default path's drift with the world size.

Two runs that agree to 1e-6 can still differ in the last bits of most weights. Counting the
differing bits (the XOR of the raw representations) shows how far apart they are without any
tolerance: 0 means bit for bit the same.
"""

from __future__ import annotations

import torch

_AS_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
           torch.float64: torch.int64}


def _popcount(x: torch.Tensor) -> int:
    """Set bits in an integer tensor (its width in bits: 8 * itemsize)."""
    total = 0
    for k in range(8 * x.element_size()):
        total += int(((x >> k) & 1).sum())
    return total


def differing_bits(a: dict, b: dict) -> dict:
    """{name: {"numel", "elements", "bits"}} for two dicts of same-named, same-shaped tensors:
    how many elements differ at all, and how many bits differ in total."""
    if a.keys() != b.keys():
        raise ValueError(f"differing_bits: the two sets name different tensors: {sorted(a.keys() ^ b.keys())}")
    out = {}
    for name in a:
        x, y = a[name].detach(), b[name].detach()
        if x.shape != y.shape or x.dtype != y.dtype or x.dtype not in _AS_INT:
            raise ValueError(f"differing_bits: {name!r} differs in shape or dtype, or is not a float tensor")
        xor = x.contiguous().view(_AS_INT[x.dtype]) ^ y.contiguous().view(_AS_INT[x.dtype])
        out[name] = {"numel": x.numel(), "elements": int((xor != 0).sum()), "bits": _popcount(xor)}
    return out
