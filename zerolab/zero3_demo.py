"""Runs for chapter 8 (ZeRO-3): launched workers, measured on every rank, returned to the parent."""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

import zerolab as zl
from zerolab.data import CharDataset
from zerolab.memory import saved_activation_bytes
from zerolab.models import GPT, gpt_config, gpt_loss
from zerolab.single import SingleProcess
from zerolab.zero3 import ZeRO3, gpt_init, measure_peak

OPT = partial(torch.optim.AdamW, lr=1e-3, eps=1e-6, weight_decay=0.1)
B = 2


def _model(size):
    torch.manual_seed(0)
    return GPT(gpt_config(size, bias=False))


def _records(ledger):
    return [(r.op, r.tag, r.start, r.end, r.bytes_sent) for r in ledger.records]


def zero3_run(size="nano", prefetches=(1,), steps=3):
    """Train `steps` steps per prefetch setting; measure the last one (and DDP's, same run)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    data = CharDataset(gpt_config(size).block_size)
    out = {}
    for pf in prefetches:
        eng = ZeRO3(_model(size), OPT, prefetch=pf, track_peak=False)
        for s in range(steps):
            last = s == steps - 1
            if last:
                eng.comm.reset()
                eng.events.clear()
                t0 = eng.comm.now()
            batch = data.batch(s, B, rank, n)
            with measure_peak("cpu") as pk:
                (_, loss), act = saved_activation_bytes(gpt_loss, eng, batch)
                eng.backward(loss)
                eng.step()
            if not last:
                eng.zero_grad()
        out[pf] = {"events": [tuple(e) for e in eng.events], "records": _records(eng.comm), "t0": t0,
                   "memory": eng.memory_report(), "peak": pk.peak, "activations": act,
                   "bytes": eng.comm.bytes("all_gather") + eng.comm.bytes("reduce_scatter"),
                   "state": eng.full_state_dict()}
    out["psi"] = eng.num_params
    out["units"] = eng.unit_sizes()
    ddp = zl.DDP(_model(size), OPT)
    for s in range(steps):
        if s == steps - 1:
            ddp.comm.reset()
        ddp.backward(gpt_loss(ddp, data.batch(s, B, rank, n))[1])
        ddp.step()
        ddp.zero_grad()
    out["ddp_bytes"] = ddp.comm.bytes("all_reduce")
    return out


def single_reference(size="nano", n=2, steps=3):
    """One process on the global batch (n x B rows): the reference for the parity check."""
    data = CharDataset(gpt_config(size).block_size)
    eng = SingleProcess(_model(size), OPT, track_peak=False)
    for s in range(steps):
        eng.backward(gpt_loss(eng, data.batch(s, B * n))[1])
        eng.step()
        eng.zero_grad()
    return eng.full_state_dict()


def construction(size="small"):
    """Peak bytes while building and wrapping: a plain GPT vs a meta-device GPT + init_fn."""
    cfg = gpt_config(size)
    with measure_peak("cpu") as plain:
        a = ZeRO3(GPT(cfg), OPT)
    with measure_peak("cpu") as meta:
        with torch.device("meta"):
            model = GPT(cfg)
        b = ZeRO3(model, OPT, init_fn=gpt_init(cfg.n_layer))
    return {"plain": plain.peak, "meta": meta.peak, "psi": b.num_params,
            "largest": max(b.unit_sizes().values()), "after": b.memory_report()["params"],
            "same_psi": a.num_params == b.num_params}
