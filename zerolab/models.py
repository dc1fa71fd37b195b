"""The models the book trains: a small GPT, a tiny MLP, and an awkward model for tests.

The GPT follows the GPT-2 recipe in miniature (pre-LayerNorm blocks of causal
self-attention and an MLP). Its blocks live in one nn.ModuleList, which is what ZeRO-3
later uses as its units. Sizes are named so the CLI and the chapters agree on them.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 96          # zl.data's character vocabulary
    block_size: int = 64          # context length
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = False     # share the token embedding with the output head

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig: n_embd ({self.n_embd}) must be divisible by "
                             f"n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")


# Named sizes used by the CLI, chapters and benchmarks.
SIZES = {
    "nano": GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32),
    "tiny": GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64),
    "small": GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=64),
    "medium": GPTConfig(n_layer=6, n_head=6, n_embd=192, block_size=128),
    "gpt2": GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
}


def gpt_config(size: str = "tiny", **overrides) -> GPTConfig:
    """A named GPT size, optionally with fields changed (e.g. tie_weights=True)."""
    if size not in SIZES:
        raise ValueError(f"unknown GPT size {size!r}; choose one of {sorted(SIZES)}")
    return replace(SIZES[size], **overrides)


# torch 2.13's fused CPU attention in bf16 packs its operands for AVX-512 whenever the CPU has it,
# even when the vector kernels run below it (ATEN_CPU_CAPABILITY=avx2 or default, which
# `make test-kernels` sets), and then raises "pack_vnni2 is only supported when avx512 is
# supported". There, bf16 attention takes the math backend (the same formula, unfused).
_BELOW_AVX512 = torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "AVX2")


def causal_attention(q, k, v, dropout_p: float = 0.0):
    """F.scaled_dot_product_attention(q, k, v, is_causal=True), on every CPU kernel set."""
    if _BELOW_AVX512 and q.dtype == torch.bfloat16 and q.device.type == "cpu":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, heads, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = causal_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return F.dropout(self.proj(y), self.dropout, self.training)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x):
        return F.dropout(self.proj(F.gelu(self.fc(x))), self.dropout, self.training)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A GPT language model: tokens (B, T) -> logits (B, T, vocab).

    `block` builds one transformer block from the config (tensor parallelism passes its own).
    `run_block(block, x)` is how forward calls each block; activation checkpointing
    (zerolab.zero_r.activation_checkpointing) replaces it to keep only each block's input.
    """

    def __init__(self, cfg: GPTConfig, block=Block):
        super().__init__()
        self.cfg = cfg
        self.run_block = None
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.head.weight = self.tok_emb.weight
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by depth
            if name.endswith("proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, 0.0, 0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx):
        B, T = idx.shape
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} is longer than block_size {self.cfg.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x) if self.run_block is None else self.run_block(block, x)
        return self.head(self.ln_f(x))


def gpt_loss(model: nn.Module, batch):
    """(logits, mean cross-entropy) of a GPT on a batch (inputs, targets)."""
    x, y = batch
    logits = model(x)
    return logits, F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))


def num_params(model: nn.Module, trainable_only: bool = False) -> int:
    """Parameters counted once each (a tied weight is one parameter)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


# ------------------------------------------------------------------ small models for tests


class TinyMLP(nn.Module):
    """A two-layer MLP for the synthetic regression task of zl.data."""

    def __init__(self, d_in: int = 16, d_hidden: int = 32, d_out: int = 4):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, d_hidden), nn.Tanh(), nn.Linear(d_hidden, d_out))

    def forward(self, x):
        return self.net(x)


class AwkwardModel(nn.Module):
    """Every case that trips up a sharding engine, in one small model.

    * odd sizes (7, 13, 5 ...) so flat buffers need padding at any world size;
    * a frozen layer (requires_grad=False) that must be left alone;
    * an unused branch whose parameters never receive a gradient;
    * a weight used twice in one forward (its gradient is the sum of both uses);
    * tied weights: `decoder.weight` is `encoder.weight`, one tensor under two names.
    """

    def __init__(self, d_in: int = 13, d_hidden: int = 7, d_out: int = 5):
        super().__init__()
        self.encoder = nn.Linear(d_in, d_hidden)
        self.frozen = nn.Linear(d_hidden, d_hidden)
        self.frozen.requires_grad_(False)
        self.reused = nn.Linear(d_hidden, d_hidden)
        self.unused = nn.Linear(d_hidden, 3)
        self.decoder = nn.Linear(d_in, d_hidden, bias=False)
        self.decoder.weight = self.encoder.weight  # tied: decoder uses encoder.weight^T
        self.head = nn.Linear(d_in, d_out)

    def forward(self, x):
        h = torch.tanh(self.encoder(x))
        h = torch.tanh(self.frozen(h))
        h = torch.tanh(self.reused(h))
        h = torch.tanh(self.reused(h))  # the same weight, a second time
        back = h @ self.decoder.weight  # tied weight, transposed use: (B, d_hidden) -> (B, d_in)
        return self.head(back + x)


def regression_loss(model: nn.Module, batch):
    """(output, mean squared error) for the synthetic task."""
    x, y = batch
    out = model(x)
    return out, F.mse_loss(out.float(), y)


# ------------------------------------------------------------------ initialising on meta (ZeRO-3)


def gpt_init(n_layer: int):
    """init_fn(name, module) for a GPT with n_layer blocks built on the meta device.

    GPT-2 style (normal(0, 0.02), zero biases, residual projections scaled by depth), each
    module seeded by its NAME, so every rank draws the same values and a normal GPT given
    `for n, m in model.named_modules(): init(n, m)` ends with exactly the same weights.
    """
    def init(name: str, module: nn.Module) -> None:
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        if isinstance(module, nn.LayerNorm):
            module.reset_parameters()
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("proj") else 0.02
            module.weight.normal_(0.0, std, generator=g)
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.zero_()
    return init
