"""Floating-point formats, bit by bit: fp32, fp16, bf16 and the two fp8 formats.

A binary floating-point number is stored as a sign bit s, an exponent field e and a
mantissa (fraction) field m. For a normal number (0 < e < all ones)

    value = (-1)^s * 2^(e - bias) * (1 + m / 2^M)            M = mantissa bits

and for a subnormal (e = 0) the leading 1 disappears and the exponent stops falling:

    value = (-1)^s * 2^(1 - bias) * (m / 2^M)

Every function here does its own arithmetic (in float64, which holds every value of every
format exactly), so it works without an fp8-capable torch. The tests check it bit for bit
against torch's casts where torch has the dtype.

Rounding is round-to-nearest, ties to even, as in IEEE 754 and torch's casts. What happens
past the largest finite value depends on the format: fp32, fp16, bf16 and e5m2 go to inf;
e4m3 has no inf, and torch's cast saturates to +-448, which is what we do too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Format:
    """A binary floating-point format."""

    name: str
    exponent_bits: int
    mantissa_bits: int
    has_inf: bool = True           # e4m3 spends the all-ones exponent on finite values instead
    torch_dtype_name: str = ""     # the torch dtype with this layout, if torch has it

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def bias(self) -> int:
        return 2 ** (self.exponent_bits - 1) - 1

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal number."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest finite number."""
        top = 2**self.exponent_bits - 1  # the all-ones field
        return (top - 1 if self.has_inf else top) - self.bias

    @property
    def max(self) -> float:
        """Largest finite value."""
        if self.has_inf:
            return (2 - 2.0**-self.mantissa_bits) * 2.0**self.emax
        # e4m3: all-ones exponent with all-ones mantissa is NaN, so the top mantissa is 1...10
        return (2 - 2 * 2.0**-self.mantissa_bits) * 2.0**self.emax

    @property
    def torch_dtype(self):
        """The torch dtype with this layout, or None where this torch build lacks it."""
        return getattr(torch, self.torch_dtype_name, None)


FORMATS = {
    "fp32": Format("fp32", 8, 23, True, "float32"),
    "fp16": Format("fp16", 5, 10, True, "float16"),
    "bf16": Format("bf16", 8, 7, True, "bfloat16"),
    "e4m3": Format("e4m3", 4, 3, False, "float8_e4m3fn"),
    "e5m2": Format("e5m2", 5, 2, True, "float8_e5m2"),
}
NAMES = tuple(FORMATS)


def get_format(fmt) -> Format:
    """A Format from its name ("fp32", "fp16", "bf16", "e4m3", "e5m2") or a Format itself."""
    if isinstance(fmt, Format):
        return fmt
    if isinstance(fmt, str) and fmt in FORMATS:
        return FORMATS[fmt]
    raise ValueError(f"unknown floating-point format {fmt!r}; choose one of {', '.join(map(repr, NAMES))}")


# ------------------------------------------------------------------ the landmarks of a format


def eps(fmt) -> float:
    """Machine epsilon: the spacing just above 1.0, 2^-M."""
    return 2.0 ** -get_format(fmt).mantissa_bits


def smallest_normal(fmt) -> float:
    return 2.0 ** get_format(fmt).emin


def smallest_subnormal(fmt) -> float:
    f = get_format(fmt)
    return 2.0 ** (f.emin - f.mantissa_bits)


def largest(fmt) -> float:
    """Largest finite value."""
    return get_format(fmt).max


def decimal_digits(fmt) -> float:
    """Decimal digits of precision, log10(2^(M+1))."""
    return (get_format(fmt).mantissa_bits + 1) * math.log10(2)


def dynamic_range(fmt) -> float:
    """Decades between the smallest subnormal and the largest finite value."""
    return math.log10(largest(fmt) / smallest_subnormal(fmt))


def summary(fmt) -> dict:
    """The numbers a table of formats shows."""
    f = get_format(fmt)
    return {"format": f.name, "bits": f.bits, "exponent": f.exponent_bits, "mantissa": f.mantissa_bits,
            "eps": eps(f), "smallest subnormal": smallest_subnormal(f),
            "smallest normal": smallest_normal(f), "largest": largest(f),
            "digits": decimal_digits(f), "decades": dynamic_range(f)}


# ------------------------------------------------------------------ rounding


def _exponent(a: torch.Tensor) -> torch.Tensor:
    """floor(log2(a)) for a > 0, exactly (frexp gives a = m * 2^e with m in [0.5, 1))."""
    return torch.frexp(a)[1].to(torch.float64) - 1


def round_to(x, fmt, *, stochastic: bool = False, generator: torch.Generator | None = None):
    """x rounded to the nearest value of `fmt` (ties to even), as a float64 tensor (or float).

    stochastic=True rounds up with probability equal to the distance from the value below,
    divided by the spacing, so that the expected result is x itself.
    """
    f = get_format(fmt)
    scalar = not isinstance(x, torch.Tensor)
    if scalar and not stochastic:
        return _round_scalar(float(x), f)
    x = torch.as_tensor(x, dtype=torch.float64)
    a = x.abs()
    finite = torch.isfinite(x) & (a > 0)
    # spacing of the format at |x|: 2^(e - M), where subnormals keep e = emin
    e = torch.clamp(_exponent(torch.where(finite, a, torch.ones_like(a))), min=f.emin)
    q = torch.exp2(e - f.mantissa_bits)
    if stochastic:
        u = torch.rand(a.shape, generator=generator, dtype=torch.float64)
        down = torch.floor(a / q)
        r = (down + (u < a / q - down).to(torch.float64)) * q
    else:
        r = torch.round(a / q) * q  # torch.round rounds half to even; a / q is exact
    # past the largest finite value: inf, or saturation for e4m3 (as torch's cast does)
    over = r > f.max
    r = torch.where(over, torch.full_like(r, math.inf if f.has_inf else f.max), r)
    r = torch.where(finite, torch.copysign(r, x), x)  # zeros, infs and nans pass through
    if not f.has_inf:
        r = torch.where(torch.isinf(x), torch.copysign(torch.full_like(r, f.max), x), r)
    return r.item() if scalar else r


def _round_scalar(x: float, f: Format) -> float:
    """round_to for one Python float, in plain Python (fast enough for summation loops)."""
    if x == 0 or not math.isfinite(x):
        if math.isinf(x) and not f.has_inf:
            return math.copysign(f.max, x)
        return x
    a = abs(x)
    e = max(math.frexp(a)[1] - 1, f.emin)
    q = math.ldexp(1.0, e - f.mantissa_bits)
    r = round(a / q) * q  # Python's round() is half to even
    if r > f.max:
        r = math.inf if f.has_inf else f.max
    return math.copysign(r, x)


def ulp(x, fmt):
    """Spacing of `fmt` at magnitude |x|: the gap from |x| (rounded) to the next larger value."""
    f = get_format(fmt)
    scalar = not isinstance(x, torch.Tensor)
    a = torch.as_tensor(round_to(x, f), dtype=torch.float64).abs()
    e = torch.clamp(_exponent(torch.where(a > 0, a, torch.ones_like(a))), min=f.emin)
    e = torch.where(a > 0, e, torch.full_like(e, float(f.emin)))
    out = torch.exp2(e - f.mantissa_bits)
    out = torch.where(torch.isfinite(a), out, torch.full_like(out, math.nan))
    return out.item() if scalar else out


def changes(x, dx, fmt) -> bool:
    """Does x + dx differ from x when both are stored in `fmt` and the sum is rounded to `fmt`?"""
    f = get_format(fmt)
    xs = round_to(float(x), f)
    return round_to(xs + round_to(float(dx), f), f) != xs


def add(x, dx, fmt) -> float:
    """x + dx in `fmt`: both operands stored in the format, the exact sum rounded once."""
    f = get_format(fmt)
    return round_to(round_to(float(x), f) + round_to(float(dx), f), f)


# ------------------------------------------------------------------ bits


def to_bits(x, fmt):
    """The bit pattern of x rounded to `fmt`, as an int (or an int64 tensor for a tensor x)."""
    f = get_format(fmt)
    scalar = not isinstance(x, torch.Tensor)
    v = torch.as_tensor(round_to(x, f), dtype=torch.float64)
    M, top = f.mantissa_bits, 2**f.exponent_bits - 1
    sign = torch.signbit(v).to(torch.int64)
    a = v.abs()
    normal = a >= smallest_normal(f)
    e = torch.clamp(_exponent(torch.where(a > 0, a, torch.ones_like(a))), min=f.emin)
    field = torch.where(normal, e + f.bias, torch.zeros_like(e))
    frac = torch.where(normal, a / torch.exp2(e) - 1, a / 2.0**f.emin)  # in [0, 1)
    mant = torch.round(frac * 2**M)
    if f.has_inf:
        field = torch.where(torch.isinf(a) | torch.isnan(a), torch.full_like(field, top), field)
        mant = torch.where(torch.isinf(a), torch.zeros_like(mant), mant)
        mant = torch.where(torch.isnan(a), torch.full_like(mant, 2 ** (M - 1)), mant)  # quiet NaN
    else:
        field = torch.where(torch.isnan(a), torch.full_like(field, top), field)
        mant = torch.where(torch.isnan(a), torch.full_like(mant, 2**M - 1), mant)
    bits = (sign << (f.bits - 1)) | (field.to(torch.int64) << M) | mant.to(torch.int64)
    return int(bits.item()) if scalar else bits


def from_bits(bits, fmt):
    """The value a bit pattern encodes in `fmt` (a float, or a float64 tensor for a tensor)."""
    f = get_format(fmt)
    scalar = not isinstance(bits, torch.Tensor)
    b = torch.as_tensor(bits, dtype=torch.int64)
    if bool(((b < 0) | (b >= 2**f.bits)).any()):
        raise ValueError(f"a {f.name} bit pattern must be in [0, 2^{f.bits}); got {bits!r}")
    M, top = f.mantissa_bits, 2**f.exponent_bits - 1
    sign = (b >> (f.bits - 1)) & 1
    field = ((b >> M) & top).to(torch.float64)
    mant = (b & (2**M - 1)).to(torch.float64)
    normal = 2.0 ** (field - f.bias) * (1 + mant / 2**M)
    sub = 2.0**f.emin * (mant / 2**M)
    v = torch.where(field > 0, normal, sub)
    if f.has_inf:
        special = torch.where(mant == 0, torch.full_like(v, math.inf), torch.full_like(v, math.nan))
        v = torch.where(field == top, special, v)
    else:
        v = torch.where((field == top) & (mant == 2**M - 1), torch.full_like(v, math.nan), v)
    v = torch.where(sign == 1, -v, v)
    return v.item() if scalar else v


@dataclass(frozen=True)
class Bits:
    """One value of a format, taken apart."""

    format: str
    sign: int
    exponent: int        # the stored field
    mantissa: int        # the stored field
    value: float         # what the bits mean
    kind: str            # "zero", "subnormal", "normal", "inf" or "nan"

    def bit_string(self) -> str:
        f = get_format(self.format)
        return (f"{self.sign} {self.exponent:0{f.exponent_bits}b} "
                f"{self.mantissa:0{f.mantissa_bits}b}")


def decompose(x: float, fmt) -> Bits:
    """Round x to `fmt` and take it apart into sign, exponent field and mantissa field."""
    f = get_format(fmt)
    bits = to_bits(float(x), f)
    return _bits(bits, f)


def compose(sign: int, exponent: int, mantissa: int, fmt) -> float:
    """The value with these fields (the inverse of decompose)."""
    f = get_format(fmt)
    for name, value, width in (("sign", sign, 1), ("exponent", exponent, f.exponent_bits),
                               ("mantissa", mantissa, f.mantissa_bits)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**width:
            raise ValueError(f"{f.name}: the {name} field has {width} bits, so it must be an int in "
                             f"[0, {2**width}); got {value!r}")
    return from_bits((sign << (f.bits - 1)) | (exponent << f.mantissa_bits) | mantissa, f)


def _bits(bits: int, f: Format) -> Bits:
    M, top = f.mantissa_bits, 2**f.exponent_bits - 1
    sign, field, mant = bits >> (f.bits - 1), (bits >> M) & top, bits & (2**M - 1)
    value = from_bits(bits, f)
    if math.isnan(value):
        kind = "nan"
    elif math.isinf(value):
        kind = "inf"
    elif field == 0:
        kind = "zero" if mant == 0 else "subnormal"
    else:
        kind = "normal"
    return Bits(f.name, sign, field, mant, value, kind)


# ------------------------------------------------------------------ summation in a format


def sum_naive(values, fmt) -> float:
    """Left-to-right sum with the running total stored in `fmt` after every addition."""
    f = get_format(fmt)
    total = 0.0
    for v in values:
        total = round_to(total + round_to(float(v), f), f)
    return total


def sum_pairwise(values, fmt) -> float:
    """Sum the two halves recursively, then add them: error grows like log n, not n."""
    f = get_format(fmt)
    vals = [round_to(float(v), f) for v in values]

    def rec(lo, hi):
        if hi - lo == 1:
            return vals[lo]
        mid = (lo + hi) // 2
        return round_to(rec(lo, mid) + rec(mid, hi), f)

    return rec(0, len(vals)) if vals else 0.0


def sum_kahan(values, fmt) -> float:
    """Kahan's compensated sum, every operation rounded to `fmt`: a second variable keeps
    the low-order bits that each addition to the running total throws away."""
    f = get_format(fmt)
    total, comp = 0.0, 0.0
    for v in values:
        y = round_to(round_to(float(v), f) - comp, f)
        t = round_to(total + y, f)
        comp = round_to(round_to(t - total, f) - y, f)
        total = t
    return total
