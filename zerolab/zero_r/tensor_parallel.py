"""The smallest honest tensor parallelism (Megatron-LM style) for the book's GPT.

A linear layer y = x W^T can be split two ways across the mp ranks of a Mesh:

* column parallel: each rank keeps a slice of W's output rows and computes a slice of y.
  The input must be the same on every rank (f: identity forward, all-reduce of its
  gradient in backward).
* row parallel: each rank keeps a slice of W's input columns, takes the matching slice
  of x, and computes a partial y; the partial results are summed (g: all-reduce forward,
  identity backward).

Column then row needs no communication in between, so a transformer block costs one
all-reduce in forward and one in backward for attention (heads split across ranks), and
the same again for the MLP. LayerNorms, embeddings and the output head stay replicated:
their inputs are identical on every mp rank, so their gradients are too.

Every mp rank holds the full activations at the block boundaries: that replication is
what ZeRO-R's partitioned activation checkpoints remove (zerolab.zero_r.activation_checkpointing).
Dropout inside the tensor-parallel regions would need per-rank RNG streams; the book's
runs use dropout 0 here.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .mesh import Mesh
from ..models import GPT, GPTConfig


class _CopyToModelParallel(torch.autograd.Function):
    """f: the same input on every mp rank; gradients from every rank are summed."""

    @staticmethod
    def forward(ctx, x, mesh):
        ctx.mesh = mesh
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        ctx.mesh.ledger.all_reduce(grad, group=ctx.mesh.mp_group, tag="tp_backward")
        return grad, None


class _ReduceFromModelParallel(torch.autograd.Function):
    """g: partial results of the mp ranks are summed; the gradient passes through."""

    @staticmethod
    def forward(ctx, x, mesh):
        out = x.contiguous().clone()
        mesh.ledger.all_reduce(out, group=mesh.mp_group, tag="tp_forward")
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_model_parallel(x, mesh: Mesh):
    return _CopyToModelParallel.apply(x, mesh) if mesh.mp > 1 else x


def reduce_from_model_parallel(x, mesh: Mesh):
    return _ReduceFromModelParallel.apply(x, mesh) if mesh.mp > 1 else x


def _split(n: int, mesh: Mesh, what: str) -> int:
    if n % mesh.mp:
        raise ValueError(f"tensor parallelism: {what} ({n}) is not divisible by mp={mesh.mp}")
    return n // mesh.mp


class TensorParallelAttention(nn.Module):
    """Causal self-attention with the heads split across the mp ranks."""

    def __init__(self, cfg: GPTConfig, mesh: Mesh):
        super().__init__()
        self.mesh = mesh
        self.heads = _split(cfg.n_head, mesh, "the number of attention heads")
        self.width = _split(cfg.n_embd, mesh, "the hidden size")
        # local rows of the fused q, k, v projection: [q_i; k_i; v_i], each `width` rows
        self.qkv = nn.Linear(cfg.n_embd, 3 * self.width, bias=cfg.bias)    # column parallel
        self.proj = nn.Linear(self.width, cfg.n_embd, bias=False)          # row parallel
        self.proj_bias = nn.Parameter(torch.zeros(cfg.n_embd)) if cfg.bias else None

    def forward(self, x):
        B, T, _ = x.shape
        h = copy_to_model_parallel(x, self.mesh)
        q, k, v = self.qkv(h).split(self.width, dim=2)
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, self.width)
        out = reduce_from_model_parallel(self.proj(y), self.mesh)
        return out if self.proj_bias is None else out + self.proj_bias


class TensorParallelMLP(nn.Module):
    def __init__(self, cfg: GPTConfig, mesh: Mesh):
        super().__init__()
        self.mesh = mesh
        width = _split(4 * cfg.n_embd, mesh, "the MLP width")
        self.fc = nn.Linear(cfg.n_embd, width, bias=cfg.bias)              # column parallel
        self.proj = nn.Linear(width, cfg.n_embd, bias=False)               # row parallel
        self.proj_bias = nn.Parameter(torch.zeros(cfg.n_embd)) if cfg.bias else None

    def forward(self, x):
        h = F.gelu(self.fc(copy_to_model_parallel(x, self.mesh)))
        out = reduce_from_model_parallel(self.proj(h), self.mesh)
        return out if self.proj_bias is None else out + self.proj_bias


class TensorParallelBlock(nn.Module):
    def __init__(self, cfg: GPTConfig, mesh: Mesh):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = TensorParallelAttention(cfg, mesh)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = TensorParallelMLP(cfg, mesh)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TensorParallelGPT(GPT):
    """The book's GPT with every block split across the mesh's mp group."""

    def __init__(self, cfg: GPTConfig, mesh: Mesh):
        if cfg.dropout:
            raise ValueError("TensorParallelGPT: dropout must be 0 (see the module docstring)")
        _split(cfg.n_head, mesh, "the number of attention heads")
        super().__init__(cfg, block=lambda c: TensorParallelBlock(c, mesh))
        self.mesh = mesh

    @classmethod
    def from_dense(cls, dense: GPT, mesh: Mesh) -> "TensorParallelGPT":
        """This rank's shard of an ordinary GPT: the same function, split across mp ranks."""
        cfg = dense.cfg
        tp = cls(cfg, mesh)
        tp.load_state_dict(shard_state_dict(dense.state_dict(), cfg, mesh))
        if cfg.tie_weights:
            tp.head.weight = tp.tok_emb.weight
        return tp


def _rows(t, i, n):
    size = t.shape[0] // n
    return t[i * size:(i + 1) * size]


def shard_state_dict(dense: dict, cfg: GPTConfig, mesh: Mesh) -> dict:
    """Map a dense GPT state dict onto this rank's TensorParallelGPT state dict."""
    i, n, C = mesh.mp_rank, mesh.mp, cfg.n_embd
    out = {}
    for key, t in dense.items():
        if ".attn.qkv." in key:   # [q; k; v] each C rows -> [q_i; k_i; v_i]
            out[key] = torch.cat([_rows(part, i, n) for part in t.split(C, dim=0)]).clone()
        elif key.endswith("attn.proj.weight") or key.endswith("mlp.proj.weight"):
            out[key] = _rows(t.t(), i, n).t().contiguous()            # input columns
        elif key.endswith("attn.proj.bias") or key.endswith("mlp.proj.bias"):
            out[key.replace("proj.bias", "proj_bias")] = t.clone()    # added once, after the sum
        elif ".mlp.fc." in key:
            out[key] = _rows(t, i, n).clone()                         # output rows
        else:
            out[key] = t.clone()                                      # replicated
    return out


def dense_grad_shard(name: str, grad: torch.Tensor, cfg: GPTConfig, mesh: Mesh) -> torch.Tensor:
    """The part of a dense gradient that parameter `name` of this rank's shard corresponds to."""
    return shard_state_dict({name: grad}, cfg, mesh)[name.replace("proj.bias", "proj_bias")
                                                     if name.endswith("proj.bias") else name]
