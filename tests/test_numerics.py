"""zl.numerics against torch's casts, torch.finfo, torch.nextafter, torch arithmetic and exact values."""

import math

import pytest
import torch

from zerolab.theory import numerics as N

TORCH_FORMATS = [f for f in N.NAMES if N.get_format(f).torch_dtype is not None]
UINT = {8: torch.uint8, 16: torch.int16, 32: torch.int32}


def _torch_bits(x32: torch.Tensor, fmt) -> torch.Tensor:
    """Bit patterns of torch's cast of float32 values, as non-negative int64."""
    f = N.get_format(fmt)
    b = x32.to(f.torch_dtype).view(UINT[f.bits]).to(torch.int64)
    return b & (2**f.bits - 1)


def _random_float32(n, seed):
    """Values over every magnitude a format can meet: subnormal to overflow, both signs."""
    g = torch.Generator().manual_seed(seed)
    mant = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
    expo = torch.randint(-150, 128, (n,), generator=g).to(torch.float64)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
    return (sign * mant * torch.exp2(expo)).to(torch.float32)


def test_torch_has_the_formats_we_compare_with():
    assert {"fp32", "fp16", "bf16"} <= set(TORCH_FORMATS)


@pytest.mark.parametrize("fmt", TORCH_FORMATS)
def test_rounding_matches_torch_cast_bit_for_bit(fmt):
    f = N.get_format(fmt)
    x = _random_float32(200_000, seed=f.bits + f.mantissa_bits)
    # also values near the format's own range, where subnormals and overflow happen
    near = (torch.rand(50_000, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 2 - 1)
    scale = torch.exp2(torch.randint(f.emin - f.mantissa_bits - 2, f.emax + 2, (50_000,),
                                     generator=torch.Generator().manual_seed(2)).to(torch.float64))
    x = torch.cat([x, (near * scale).to(torch.float32),
                   torch.tensor([0.0, -0.0, math.inf, -math.inf, f.max, -f.max])])
    finite = torch.isfinite(x)
    # torch's CPU cast to e4m3 turned an overflow into NaN before pytorch/pytorch#178817 (2026)
    # made it saturate, as the OCP spec's saturating mode and zerolab do: on such a torch the
    # reference for those elements is its cast of the saturated value
    old_nan = ~torch.isnan(x) & torch.isnan(x.to(f.torch_dtype).to(torch.float32))
    x_ref = torch.where(old_nan, torch.sign(x) * f.max, x)
    ref = _torch_bits(x_ref, fmt)
    mine = N.to_bits(x.to(torch.float64), fmt)
    assert torch.equal(mine[finite], ref[finite])
    ref_val = x_ref.to(f.torch_dtype).to(torch.float64)
    got = N.round_to(x.to(torch.float64), fmt)
    assert torch.equal(got, ref_val)  # values, infs (and e4m3's saturation) included
    assert torch.isnan(N.round_to(torch.tensor([math.nan]), fmt)).all()


@pytest.mark.parametrize("fmt", [f for f in TORCH_FORMATS if N.get_format(f).bits <= 16])
def test_ties_round_to_even_like_torch(fmt):
    f = N.get_format(fmt)
    # every (or a random sample of) bit patterns, and the exact midpoints between neighbours
    patterns = torch.arange(2**f.bits) if f.bits == 8 else torch.randint(0, 2**16, (20_000,),
                                                                         generator=torch.Generator().manual_seed(0))
    pos = patterns[(patterns >> (f.bits - 1)) == 0]
    vals = pos.to(UINT[f.bits]).view(f.torch_dtype).to(torch.float64)
    nxt = (pos + 1).to(UINT[f.bits]).view(f.torch_dtype).to(torch.float64)
    ok = torch.isfinite(vals) & torch.isfinite(nxt)
    mid = ((vals + nxt) / 2)[ok].to(torch.float32)  # exact: needs M + 2 bits <= 24
    assert torch.equal(N.round_to(mid.to(torch.float64), fmt), mid.to(f.torch_dtype).to(torch.float64))


@pytest.mark.parametrize("fmt", TORCH_FORMATS)
def test_from_bits_matches_torch_view(fmt):
    f = N.get_format(fmt)
    if f.bits == 32:
        b = torch.randint(0, 2**31 - 1, (100_000,), generator=torch.Generator().manual_seed(3))
        b = torch.cat([b, b | (1 << 31)])
    else:
        b = torch.arange(2**f.bits)
    ref = (b if f.bits == 32 else b.to(UINT[f.bits])).to(UINT[f.bits]).view(f.torch_dtype).to(torch.float64)
    got = N.from_bits(b, fmt)
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    assert torch.equal(got[~torch.isnan(ref)], ref[~torch.isnan(ref)])
    # and back: every non-NaN pattern survives to_bits(from_bits(.))
    keep = ~torch.isnan(ref)
    assert torch.equal(N.to_bits(got[keep], fmt), b[keep] & (2**f.bits - 1))


@pytest.mark.parametrize("fmt", TORCH_FORMATS)
def test_landmarks_match_finfo_and_nextafter(fmt):
    f = N.get_format(fmt)
    info = torch.finfo(f.torch_dtype)
    assert N.eps(fmt) == info.eps
    assert N.smallest_normal(fmt) == info.smallest_normal
    assert N.largest(fmt) == info.max
    assert f.bits == info.bits
    # the smallest subnormal is the pattern 0...01
    one = torch.tensor([1], dtype=UINT[f.bits]).view(f.torch_dtype).item()
    assert N.smallest_subnormal(fmt) == one
    if f.bits >= 16:
        zero = torch.zeros(1, dtype=f.torch_dtype)
        assert N.smallest_subnormal(fmt) == torch.nextafter(zero, torch.ones_like(zero)).item()


def test_exact_landmarks():
    assert N.largest("fp16") == 65504 and N.largest("e4m3") == 448 and N.largest("e5m2") == 57344
    assert N.smallest_subnormal("fp16") == 2.0**-24 and N.smallest_normal("fp16") == 2.0**-14
    assert N.smallest_subnormal("e4m3") == 2.0**-9 and N.smallest_normal("e5m2") == 2.0**-14
    assert N.largest("bf16") == (2 - 2.0**-7) * 2.0**127
    assert N.eps("fp32") == 2.0**-23


@pytest.mark.parametrize("fmt", [f for f in TORCH_FORMATS if N.get_format(f).bits >= 16])
def test_ulp_matches_nextafter(fmt):
    f = N.get_format(fmt)
    x = _random_float32(20_000, seed=7).abs().to(f.torch_dtype)
    x = x[torch.isfinite(x) & (x < f.max)]
    gap = (torch.nextafter(x, torch.full_like(x, math.inf)).to(torch.float64) - x.to(torch.float64))
    assert torch.equal(N.ulp(x.to(torch.float64), fmt), gap)


@pytest.mark.parametrize("fmt", [f for f in TORCH_FORMATS if N.get_format(f).bits == 8])
def test_ulp_fp8_matches_next_bit_pattern(fmt):
    f = N.get_format(fmt)
    b = torch.arange(0, 2 ** (f.bits - 1) - 1, dtype=torch.uint8)   # positive patterns
    vals = b.view(f.torch_dtype).to(torch.float64)
    nxt = (b + 1).view(f.torch_dtype).to(torch.float64)
    ok = torch.isfinite(nxt) & torch.isfinite(vals)
    assert torch.equal(N.ulp(vals[ok], fmt), (nxt - vals)[ok])


def test_ulp_exact_values():
    assert N.ulp(1.0, "fp16") == 2.0**-10 and N.ulp(1.0, "bf16") == 2.0**-7
    assert N.ulp(1.0, "fp32") == 2.0**-23 and N.ulp(1000.0, "fp16") == 0.5
    assert N.ulp(0.0, "fp16") == 2.0**-24 and N.ulp(1e-7, "fp16") == 2.0**-24  # subnormal spacing
    assert N.ulp(1.0, "e4m3") == 0.125 and N.ulp(1.0, "e5m2") == 0.25


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "bf16"])
def test_changes_matches_torch_arithmetic(fmt):
    dtype = N.get_format(fmt).torch_dtype
    g = torch.Generator().manual_seed(11)
    xs = (torch.rand(300, generator=g, dtype=torch.float64) * 4 - 2).to(dtype)
    for x in xs.tolist():
        for k in range(-30, 0, 3):
            dx = (torch.rand(1, generator=g).item() + 0.5) * 2.0**k
            dx_t = torch.tensor(dx).to(dtype)
            x_t = torch.tensor(x, dtype=dtype)
            assert N.changes(x, dx, fmt) == bool(x_t + dx_t != x_t), (x, dx)
            assert N.add(x, dx, fmt) == (x_t + dx_t).item()


def test_lost_small_update_exact():
    # theta = 1, delta = 1e-5: only fp32 (spacing 1.2e-7 at 1) keeps it
    assert [N.changes(1.0, 1e-5, f) for f in N.NAMES] == [True, False, False, False, False]
    assert N.changes(1.0, 0.0625, "e4m3") is False  # exactly half a spacing: ties to even (1.0)
    assert N.changes(1.0, 0.07, "e4m3") is True
    assert N.changes(1.0, 2.0**-11 + 2.0**-20, "fp16") is True


def test_decompose_compose_exact():
    b = N.decompose(1.0, "fp16")
    assert (b.sign, b.exponent, b.mantissa, b.kind) == (0, 15, 0, "normal")
    assert b.bit_string() == "0 01111 0000000000"
    b = N.decompose(-2.5, "bf16")  # -1.25 * 2^1
    assert (b.sign, b.exponent, b.mantissa, b.value) == (1, 128, 32, -2.5)
    b = N.decompose(0.1, "e4m3")  # 0.1 rounds to 13/128 = 1.625 * 2^-4
    assert (b.exponent, b.mantissa, b.value) == (3, 5, 0.1015625)
    assert N.decompose(2.0**-20, "fp16").kind == "subnormal"
    assert N.decompose(1e6, "fp16").kind == "inf" and N.decompose(1e6, "e4m3").value == 448
    assert N.decompose(float("nan"), "e5m2").kind == "nan"
    assert N.compose(0, 0, 1, "fp16") == 2.0**-24
    assert N.compose(0, 30, 1023, "fp16") == 65504
    assert N.compose(1, 15, 6, "e4m3") == -448  # e4m3: the all-ones exponent is still finite...
    assert math.isnan(N.compose(0, 15, 7, "e4m3"))  # ...except with an all-ones mantissa
    assert math.isinf(N.compose(0, 31, 0, "e5m2"))
    with pytest.raises(ValueError, match="mantissa"):
        N.compose(0, 1, 8, "e4m3")
    with pytest.raises(ValueError, match="exponent"):
        N.compose(0, 32, 0, "fp16")


@pytest.mark.parametrize("bad", ["fp64", "e4m3fn", "FP16", 16, None])
def test_unknown_format_names_value_and_choices(bad):
    for fn in (N.eps, N.largest, lambda f: N.round_to(1.0, f), lambda f: N.changes(1, 1, f)):
        with pytest.raises(ValueError) as e:
            fn(bad)
        assert repr(bad) in str(e.value) and "'e5m2'" in str(e.value)


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "e4m3"])
def test_stochastic_rounding_keeps_the_expected_value(fmt):
    x = 1.0 + 0.3 * N.ulp(1.0, fmt)  # 30% of the way from 1 to its upper neighbour
    n = 200_000
    r = N.round_to(torch.full((n,), x, dtype=torch.float64), fmt, stochastic=True,
                   generator=torch.Generator().manual_seed(0))
    lo, hi = 1.0, 1.0 + N.ulp(1.0, fmt)
    assert set(r.unique().tolist()) == {lo, hi}  # only ever the two neighbours
    # the mean is x within 5 standard errors (p(1-p) ulp^2 / n)
    se = math.sqrt(0.3 * 0.7 / n) * N.ulp(1.0, fmt)
    assert abs(r.mean().item() - x) < 5 * se
    assert N.round_to(x, fmt) == 1.0  # nearest rounding always loses the 0.3


def test_stochastic_rounding_survives_small_updates():
    g = torch.Generator().manual_seed(0)
    theta = torch.ones(1000, dtype=torch.float64)
    for _ in range(100):  # 100 updates of 1e-4 each: fp16 nearest rounding keeps 1.0
        theta = N.round_to(theta + 1e-4, "fp16", stochastic=True, generator=g)
    assert abs(theta.mean().item() - 1.01) < 0.001
    assert N.round_to(1.0 + 1e-4, "fp16") == 1.0


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_naive_sum_matches_torch_running_sum(fmt):
    dtype = N.get_format(fmt).torch_dtype
    vals = torch.rand(400, generator=torch.Generator().manual_seed(5)).to(dtype)
    total = torch.zeros((), dtype=dtype)
    for v in vals:
        total = total + v
    assert N.sum_naive(vals.tolist(), fmt) == total.item()


def test_summation_errors():
    vals = [0.1] * 4096
    # 0.1 in fp16 is 0.0999755859375; at 256 the spacing is 0.25, so adding it changes nothing
    assert N.sum_naive(vals, "fp16") == 256.0
    exact = math.fsum([N.round_to(0.1, "fp16")] * 4096)
    assert abs(N.sum_kahan(vals, "fp16") - exact) <= N.ulp(exact, "fp16")
    assert abs(N.sum_pairwise(vals, "fp16") - exact) <= 2 * N.ulp(exact, "fp16")
    assert N.sum_pairwise([], "fp16") == 0.0
