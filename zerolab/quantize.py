"""Block-wise quantization: a tensor as small integers plus one scale per block (ZeRO++).

    q = quantize(x, bits=8, block=256)     # q.payload: int8 codes, q.scales: fp32, one per block
    y = dequantize(q)                       # y.shape == x.shape, |y - x| <= scale / 2 per element

ZeRO++ (Wang et al., "ZeRO++: Extremely Efficient Collective Communication for Giant Model
Training") sends weights as int8 (qwZ) and gradients as int4 (qgZ) instead of 16-bit floats.
One scale for a whole tensor would let one large element crush every small one to zero, so the
tensor is cut into BLOCKS of `block` elements and each block gets its own scale:

    scale = max |x| over the block / qmax          qmax = 2**(bits-1) - 1   (127 for int8, 7 for int4)
    code  = round(x / scale), in [-qmax, qmax]     x' = code * scale

The error of one element is at most half a step, scale / 2 = max|x| / (2 qmax): 0.4 % of the
block's largest value in int8, 7 % in int4. Bytes on the wire per element: bits / 8 for the
code plus 4 / block for the scale (int8, block 256: 1.016 bytes instead of 2 for bf16).

Choices (each tested in tests/test_quantize.py):
* symmetric (no zero point): zero stays exactly zero, and a gradient's sign is never flipped;
* round half to even (torch.round): deterministic on every CPU and GPU, no randomness;
* int4 codes are stored two per byte (low nibble first), as code + 8 in [1, 15];
* the last block may be short (any length works, an empty tensor too); the codes of a short
  block are padded with zeros so every rank's payload of an equal-sized shard is equal-sized;
* a block of zeros has scale 0 and comes back as zeros; -0.0 comes back as +0.0;
* a block holding inf or NaN comes back as NaN, whole: a quantized fp16 gradient that
  overflowed must still look non-finite to the overflow check, never like a finite number.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = (4, 8)


@dataclass
class Quantized:
    """A quantized tensor: codes (uint8 for int4, two per byte; int8 for int8) and fp32 scales."""

    payload: torch.Tensor
    scales: torch.Tensor
    bits: int
    block: int
    numel: int
    shape: torch.Size
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of codes and scales: what travels."""
        return self.payload.numel() * self.payload.element_size() + self.scales.numel() * 4


def _check(bits, block):
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits!r}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 2 or block % 2:
        raise ValueError(f"block must be an even int >= 2 (elements per scale), got {block!r}")


def n_blocks(numel: int, block: int) -> int:
    return -(-numel // block)


def payload_numel(numel: int, bits: int, block: int) -> int:
    """Elements of the payload for `numel` values: whole blocks, two int4 codes per byte."""
    codes = n_blocks(numel, block) * block
    return codes // 2 if bits == 4 else codes


def wire_bytes(numel: int, bits: int, block: int) -> int:
    """Bytes of codes plus fp32 scales for `numel` values (the closed form of Quantized.nbytes)."""
    return payload_numel(numel, bits, block) + 4 * n_blocks(numel, block)


def quantize(x: torch.Tensor, bits: int = 8, block: int = 256) -> Quantized:
    """Codes and per-block scales of x (any shape and floating dtype; flattened)."""
    _check(bits, block)
    qmax = 2 ** (bits - 1) - 1
    flat = x.detach().reshape(-1).float()
    nb = n_blocks(flat.numel(), block)
    padded = torch.zeros(nb * block, dtype=torch.float32, device=x.device)
    padded[:flat.numel()] = flat
    blocks = padded.view(nb, block)
    absmax = blocks.abs().amax(dim=1) if nb else torch.zeros(0, device=x.device)
    finite = torch.isfinite(blocks).all(dim=1) if nb else torch.zeros(0, dtype=torch.bool, device=x.device)
    scales = torch.where(finite, absmax / qmax, torch.full_like(absmax, float("nan")))
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))       # zeros and NaN blocks
    codes = torch.round(blocks / safe[:, None]).clamp_(-qmax, qmax)
    codes = torch.where(finite[:, None], codes, torch.zeros_like(codes)).to(torch.int8).reshape(-1)
    if bits == 4:
        nib = (codes + 8).to(torch.uint8).view(-1, 2)
        payload = nib[:, 0] | (nib[:, 1] << 4)
    else:
        payload = codes
    return Quantized(payload, scales, bits, block, flat.numel(), x.shape, x.dtype)


def dequantize(q: Quantized, out: torch.Tensor | None = None) -> torch.Tensor:
    """x' = code * scale, in q's dtype and shape (written into `out` if given)."""
    codes = unpack(q.payload, q.bits)
    nb = q.scales.numel()
    values = (codes.view(nb, q.block).float() * q.scales[:, None]).reshape(-1)[:q.numel]
    if out is None:
        return values.to(q.dtype).view(q.shape)
    out.view(-1).copy_(values)
    return out


def unpack(payload: torch.Tensor, bits: int) -> torch.Tensor:
    """The int8 codes in a payload (int4: two per byte, low nibble first)."""
    if bits == 8:
        return payload
    lo = (payload & 0x0F).to(torch.int8) - 8
    hi = (payload >> 4).to(torch.int8) - 8
    return torch.stack([lo, hi], dim=1).reshape(-1)


def from_parts(payload: torch.Tensor, scales: torch.Tensor, bits: int, block: int, numel: int,
               dtype: torch.dtype) -> Quantized:
    """A Quantized from a payload and scales that travelled (a 1-D tensor of numel values)."""
    return Quantized(payload, scales, bits, block, numel, torch.Size([numel]), dtype)
