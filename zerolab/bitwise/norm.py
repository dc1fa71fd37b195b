"""The gradient's squared norm, exact: the same bits whatever the layout, the shards or the order.

torch.nn.utils.clip_grad_norm_ adds per-parameter norms; a sharded engine adds per-shard squares
across ranks; a bucketed engine adds per-bucket sums. Each order rounds differently, so the clip
coefficient, and through it every weight, would change in its last bits with the world size or
the engine. Here nothing is rounded until the very end, so no order of addition can matter:

  1. The square of an fp32 number is an integer times a power of two: x = m * 2^(e-24) with m
     an integer of at most 24 bits (torch.frexp), so x^2 = m^2 * 2^(2e-48), with m^2 < 2^48.
  2. The squares are added exponent by exponent (torch.bincount): one sum of the m^2's low 24
     bits and one of their high 24 bits per exponent. Each is a sum of integers below 2^24,
     held in fp64, so it is exact up to 2^29 elements; exact sums add in any grouping, on one
     rank or across ranks (an all-reduce), to the same result.
  3. Those sums, shifted to their exponents, make one Python integer: the exact sum of squares.
     Python's float() rounds it correctly to fp64, and the norm is cast to fp32 from there.
     math.fsum of the fp64 squares is an independent reference (tests/test_bitwise_units.py).

The cost is a few elementwise operations per gradient element, and 556 fp64 numbers per
all-reduce. A NaN or an infinity in the gradient gives a NaN or infinite norm, as in torch.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

EXP_MIN = -148          # torch.frexp's exponent of the smallest fp32 number, 2^-149 = 0.5 * 2^-148
EXPONENTS = 128 - EXP_MIN + 1       # frexp's exponents of fp32 numbers: -148 .. 128
NAN, INF = 2 * EXPONENTS, 2 * EXPONENTS + 1     # two more slots: how many NaNs and infinities
MAX_ELEMENTS = 2 ** 29  # a sum of this many values below 2^24 stays below 2^53: exact in fp64


def square_sums(x: torch.Tensor) -> torch.Tensor:
    """x's squares added exactly, exponent by exponent: [low halves' sums | high halves' sums |
    NaN count | inf count], fp64 integers. Such rows add exactly (x's pieces, or ranks)."""
    x = x.detach().reshape(-1).float()
    if x.numel() >= MAX_ELEMENTS:
        raise ValueError(f"the exact norm adds at most {MAX_ELEMENTS:,} elements per call, got {x.numel():,}")
    counts = torch.zeros(2, dtype=torch.float64)
    if not bool(torch.isfinite(x).all()):       # counted, then left out of the sums
        counts = torch.tensor([float(torch.isnan(x).sum()), float(torch.isinf(x).sum())], dtype=torch.float64)
        x = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    mantissa, exponent = torch.frexp(x)
    m = (mantissa * 2 ** 24).to(torch.int64)            # exact: a 24-bit integer
    square = m * m                                      # exact: < 2^48
    index = (exponent - EXP_MIN).to(torch.int64)
    low = torch.bincount(index, weights=(square & (2 ** 24 - 1)).double(), minlength=EXPONENTS)
    high = torch.bincount(index, weights=(square >> 24).double(), minlength=EXPONENTS)
    return torch.cat([low, high, counts])


def sums_to_float(sums: torch.Tensor) -> float:
    """The sum of squares that square_sums' rows hold, correctly rounded to fp64."""
    values = sums.tolist()
    if values[NAN]:
        return math.nan
    if values[INF]:
        return math.inf
    exact = 0
    for k in range(EXPONENTS):          # m^2 * 2^(2e - 48), with e = k + EXP_MIN
        m2 = int(values[k]) + (int(values[EXPONENTS + k]) << 24)
        exact += m2 << (2 * k)
    return math.ldexp(float(exact), 2 * EXP_MIN - 48)   # float(int) rounds correctly; ldexp is exact


def exact_sum_of_squares(tensors, ledger=None, sharded: bool = False, group=None) -> torch.Tensor:
    """The squared norm of all `tensors` together (a 0-d fp32 tensor), the same bits on any layout.

    sharded=True: the tensors are this rank's shards of the gradient; the ranks' sums are
    all-reduced (integers: exact in any order) and every rank gets the whole gradient's value.
    """
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    sums = torch.zeros(2 * EXPONENTS + 2, dtype=torch.float64)
    for t in tensors:
        sums += square_sums(t).cpu()
    if sharded and dist.is_initialized() and dist.get_world_size(group) > 1:
        ledger.all_reduce(sums, op="sum", group=group, tag="bitwise:norm")
    return torch.tensor(sums_to_float(sums), dtype=torch.float64).float()


def clip_coefficient(sum_of_squares: torch.Tensor, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_'s coefficient, min(1, max_norm / (norm + 1e-6)), from the
    exact squared norm: elementwise arithmetic on one number, so the same bits everywhere."""
    total = sum_of_squares.sqrt()
    return (max_norm / (total + 1e-6)).clamp(max=1.0)
