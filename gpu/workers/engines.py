"""The engines the GPU runs build: zerolab's with the parity tests' AdamW, PyTorch's peers in bf16,
and DeepSpeed's."""

from __future__ import annotations

from functools import partial
from typing import Callable, NamedTuple

import torch

from zerolab.bench import deepspeed_config, fsdp2, make_zerolab, torch_ddp
from zerolab.models import GPT

# the parity tests' optimizer (tests/test_zero.py)
OPT = partial(torch.optim.AdamW, lr=1e-3, eps=1e-6, weight_decay=0.1)


def make_engine(name, model, precision, bucket_mb, track_peak=False, **kw):
    """zerolab's engine called `name` in the tables (zerolab.bench.ZEROLAB: the CPU bench's names
    too), with the parity tests' AdamW."""
    return make_zerolab(name, model, OPT, precision=precision, bucket_mb=bucket_mb, track_peak=track_peak, **kw)


def peer(name, model, bucket_mb, dev):
    """PyTorch peers in bf16, matched to zerolab's bf16 (compute and communication in bf16 where
    the API allows): DDP under autocast (its params/grads stay fp32: autocast is PyTorch DDP's
    bf16), FSDP2 with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16). Returns the
    module to call, its optimizer, and whether to run the forward under autocast."""
    if name == "PyTorch DDP":
        m = torch_ddp(model, bucket_mb, dev)
        opt = torch.optim.AdamW(m.parameters(), lr=3e-4)
        return m, opt, True
    model = fsdp2(model, reshard=name.endswith("True"), device_type=dev.type, bf16=True)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-4), False


def deepspeed_engine(stage, model, batch, bucket_mb):
    """DeepSpeed's ZeRO-`stage` engine in bf16 with overlap, as zerolab.bench.deepspeed_config writes it."""
    import deepspeed       # (only where DeepSpeed is installed: a row without it is reported, not fatal)
    cfg = deepspeed_config(stage, batch, bucket_mb, bf16=True, overlap=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    eng, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return eng


class Built(NamedTuple):
    """An engine ready to train: its parameter count, the four calls of a step, whether its forward runs
    under autocast, and what gpu.common.state_bytes counts of it ({} for DeepSpeed, whose flat buffers
    it cannot reach)."""

    psi: int
    forward: Callable
    backward: Callable
    step: Callable
    zero_grad: Callable
    autocast: bool
    counted: dict


def build(name, cfg, batch, bucket_mb, dev) -> Built:
    """The engine called `name` in the tables (zerolab's in bf16, a PyTorch peer, or DeepSpeed's) on a
    fresh GPT(cfg), seeded alike for every engine."""
    torch.manual_seed(0)
    model = GPT(cfg).to(dev)
    psi = sum(p.numel() for p in model.parameters())
    if name.startswith("zl."):
        eng = make_engine(name, model, "bf16", bucket_mb)
        return Built(psi, eng, eng.backward, eng.step, eng.zero_grad, False, {"engine": eng})
    if name.startswith("DeepSpeed"):
        eng = deepspeed_engine(int(name[-1]), model, batch, bucket_mb)
        return Built(psi, eng, eng.backward, eng.step, (lambda: None), False, {})
    m, opt, autocast = peer(name, model, bucket_mb, dev)
    return Built(psi, m, (lambda loss: loss.backward()), opt.step, (lambda: opt.zero_grad(set_to_none=True)),
                 autocast, {"module": m, "optimizer": opt})
