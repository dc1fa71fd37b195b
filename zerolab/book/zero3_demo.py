"""Runs for chapter 8 (ZeRO-3): launched workers, measured on every rank, returned to the parent."""

from __future__ import annotations

import statistics
import time
from functools import partial

import torch
import torch.distributed as dist

import zerolab as zl
from zerolab.data import CharDataset
from zerolab.memory import AllocationTracker, saved_activation_bytes
from zerolab.models import GPT, gpt_config, gpt_loss
from zerolab.engines.single import SingleProcess
from zerolab.models import gpt_init
from zerolab.engines.zero3.units import measure_peak
from zerolab.engines.zero3 import ZeRO3

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
        eng = ZeRO3(_model(size), OPT, prefetch=pf, track_peak=True)   # step() measures its own peak
        for s in range(steps):
            last = s == steps - 1
            if last:
                eng.comm.reset()
                eng.events.clear()
                t0 = eng.comm.now()
            batch = data.batch(s, B, rank, n)
            # the whole iteration's peak; no saved-tensor hooks in here (they keep activations
            # alive longer than a plain backward does): activations come from activation_terms
            with measure_peak("cpu") as pk:
                eng.backward(gpt_loss(eng, batch)[1])
                eng.step()
            if not last:
                eng.zero_grad()
        rep = eng.memory_report()
        out[pf] = {"events": [tuple(e) for e in eng.events], "records": _records(eng.comm), "t0": t0,
                   "memory": rep, "peak": pk.peak, "step_peak": rep["peak"],
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


def activation_terms(size="nano"):
    """A plain GPT (no ZeRO) on one rank's batch of B rows, measured on its own:

    activations   bytes autograd saves in forward (saved_activation_bytes, parameters excluded)
    backward      the most bytes its backward allocates at once (AllocationTracker): activation
                  gradients, temporaries, and each parameter's fresh gradient before it is
                  added to .grad (which already exists, as ZeRO-3's flat gradient does)
    """
    model = _model(size)
    batch = CharDataset(gpt_config(size).block_size).batch(0, B)
    gpt_loss(model, batch)[1].backward()
    (_, loss), act = saved_activation_bytes(gpt_loss, model, batch, exclude=list(model.parameters()))
    with AllocationTracker() as tr:
        loss.backward()
    return {"activations": act, "backward": tr.peak}


def unit_bytes(size, n):
    """fp32 bytes of the root unit and of each block, from the model's parameter counts
    (each padded up to a multiple of n, as the flat buffers are)."""
    model = _model(size)
    pad = lambda k: -(-k // n) * n     # noqa: E731
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    root = sum(p.numel() for p in model.parameters()) - sum(blocks)
    return {"root": 4 * pad(root), "blocks": sorted((4 * pad(b) for b in blocks), reverse=True)}


def prefetch_timing(size="small", steps=16, batch=8, warmup=2):
    """Step time with prefetch=0 and prefetch=1, interleaved step by step in the same processes.

    Both engines train the same model on the same batches; before each step the ranks meet at
    a barrier, and a step's time is the slowest rank's. The order alternates every step, so a
    slow moment of the machine hits both alike. Also returns the seconds each step spent
    blocked waiting for all-gathers (ZeRO3.gather_wait_s), the part prefetch can hide, and the
    last step's event trace and ledger records for each setting (trace[pf]).
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    data = CharDataset(gpt_config(size).block_size)
    engines = {pf: ZeRO3(_model(size), OPT, prefetch=pf, track_peak=False) for pf in (0, 1)}
    times, waits, last = {0: [], 1: []}, {0: [], 1: []}, {}
    for s in range(warmup + steps):
        b = data.batch(s, batch, rank, n)
        for pf in ((0, 1) if s % 2 == 0 else (1, 0)):
            eng = engines[pf]
            dist.barrier()
            if s == warmup + steps - 1:     # the last step's trace, for the chapter's figures
                eng.comm.reset()
                eng.events.clear()
                last[pf] = eng.comm.now()
            w0, t0 = eng.gather_wait_s, time.perf_counter()
            eng.backward(gpt_loss(eng, b)[1])
            eng.step()
            eng.zero_grad()
            t = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if s >= warmup:
                times[pf].append(t.item())
                waits[pf].append(eng.gather_wait_s - w0)
    trace = {pf: {"events": [tuple(e) for e in engines[pf].events], "records": _records(engines[pf].comm),
                  "t0": t0} for pf, t0 in last.items()}
    eng = engines[1]
    return {"times": times, "waits": waits, "median_ratio": statistics.median(
        a / b for a, b in zip(times[1], times[0])), "trace": trace, "units": eng.unit_sizes(),
        "psi": eng.num_params, "shard_bytes": eng.memory_report()["params"]}
