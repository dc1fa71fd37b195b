"""zerolab.quantize against its stated contract, checked element by element: the round-trip
error is at most half a step (max |x| of the block / (2 qmax)) for every block size and both
widths; zeros (signed too), empty and odd-sized tensors; inf / NaN poison their block as NaN;
payload bytes equal the closed form; int4 packing against a hand-packed byte."""

import pytest
import torch

from zerolab import quantize as qz

BLOCKS = (2, 16, 64, 256, 1000)


@pytest.mark.parametrize("bits", (4, 8))
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("numel", (1, 7, 255, 1001))
def test_round_trip_error_is_at_most_half_a_step(bits, block, numel):
    g = torch.Generator().manual_seed(numel * 7 + block)
    # blocks of very different magnitudes: one scale per block is what keeps the small ones
    x = torch.randn(numel, generator=g) * torch.logspace(-6, 3, numel)
    y = qz.dequantize(qz.quantize(x, bits, block))
    assert y.shape == x.shape and y.dtype == x.dtype
    qmax = 2 ** (bits - 1) - 1
    for lo in range(0, numel, block):
        xb, yb = x[lo:lo + block], y[lo:lo + block]
        step = xb.abs().max() / qmax
        # half a step, plus the fp32 rounding of x / scale and code * scale (relative 2^-23 each)
        assert (yb - xb).abs().max() <= step / 2 + 4 * 2.0 ** -23 * xb.abs().max()
        assert (yb.abs().max() - xb.abs().max()).abs() <= 2 * 2.0 ** -23 * xb.abs().max()  # max is exact


def test_a_block_scale_is_its_own():
    # one huge value must not crush the next block's small ones to zero
    x = torch.tensor([1e6] + [0.0] * 15 + [1e-3] * 16)
    y = qz.dequantize(qz.quantize(x, 8, 16))
    assert torch.allclose(y[16:], x[16:], rtol=0, atol=1e-3 / 127 / 2 * 1.001)


@pytest.mark.parametrize("bits", (4, 8))
def test_zeros_signed_zeros_and_empty(bits):
    x = torch.tensor([0.0, -0.0, 0.0, -0.0])
    y = qz.dequantize(qz.quantize(x, bits, 2))
    assert torch.equal(y, torch.zeros(4)) and not torch.signbit(y).any()   # -0.0 comes back +0.0
    e = qz.quantize(torch.zeros(0), bits, 8)
    assert e.payload.numel() == 0 and e.scales.numel() == 0 and qz.dequantize(e).numel() == 0
    # sign is kept exactly: a symmetric code never flips a gradient's direction
    x = torch.tensor([-3.0, 1e-9, -1e-9, 3.0])
    y = qz.dequantize(qz.quantize(x, bits, 4))
    assert torch.equal(torch.sign(y[[0, 3]]), torch.sign(x[[0, 3]]))


@pytest.mark.parametrize("bad", (float("inf"), float("-inf"), float("nan")))
def test_non_finite_poisons_its_block_only(bad):
    x = torch.ones(12)
    x[5] = bad
    y = qz.dequantize(qz.quantize(x, 4, 4))
    assert torch.isnan(y[4:8]).all(), "an overflowed block must stay non-finite for the overflow check"
    assert torch.equal(y[:4], x[:4]) and torch.equal(y[8:], x[8:])


@pytest.mark.parametrize("bits,block,numel", [(8, 256, 1000), (4, 256, 1000), (4, 2, 3), (8, 64, 0)])
def test_payload_bytes_closed_form(bits, block, numel):
    q = qz.quantize(torch.randn(numel), bits, block)
    blocks = -(-numel // block)
    expected = blocks * block * bits // 8 + 4 * blocks       # codes (padded blocks) + fp32 scales
    assert q.nbytes == expected == qz.wire_bytes(numel, bits, block)


def test_int4_packing_low_nibble_first():
    # block of 2: scale = 7/7 = 1, codes 7 and -7 -> nibbles 15 and 1 -> byte 0x1F
    q = qz.quantize(torch.tensor([7.0, -7.0]), 4, 2)
    assert q.payload.dtype == torch.uint8 and q.payload.tolist() == [0x1F]
    assert q.scales.tolist() == [1.0]


def test_bf16_in_bf16_out():
    x = torch.randn(300).to(torch.bfloat16)
    y = qz.dequantize(qz.quantize(x, 8, 64))
    assert y.dtype == torch.bfloat16


def test_bad_arguments():
    with pytest.raises(ValueError, match="bits must be one of"):
        qz.quantize(torch.ones(4), 3, 4)
    with pytest.raises(ValueError, match="block must be an even int"):
        qz.quantize(torch.ones(4), 8, 3)
