"""Chapter 11's habits a PyTorch user brings along, tried on real ranks: torch.amp's autocast and GradScaler
beside zerolab's precision=, and sampling text from a ZeRO-3 model.

    precision_habits()   each way of training in 16 bits, one step each: what it does, or the error it gets,
                         and the bytes the step's gradient reduction sent
    sample_alone()       ZeRO-3: rank 0 alone generates: a collective only it enters, named by the watchdog
    sample_together()    every rank generates inside engine.gathered_parameters()
"""

from __future__ import annotations

import time

import torch

import zerolab as zl
from . import own_model_demo as demo


def _engine(precision, stage=2):
    """ZeRO at `stage`, or zl.DDP for stage=0, on a fresh GPT-2 and a plain AdamW built before it."""
    model = demo.gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=demo.LR)
    if stage == 0:
        return zl.DDP(model, optimizer, precision=precision, track_peak=False), optimizer
    return zl.ZeRO(model, optimizer, stage=stage, precision=precision, track_peak=False), optimizer


def _grad_bytes(engine) -> int:
    """Bytes this rank sent for the gradients in the last step (ZeRO-2's reduce-scatter, or
    zl.DDP's all-reduce of its buckets)."""
    return sum(r.bytes_sent for r in engine.comm.records
               if r.op == "reduce_scatter" or (r.op == "all_reduce" and r.tag.startswith("bucket")))


def precision_habits() -> dict:
    """One step of each habit on this rank's rows; {habit: (outcome, gradient bytes sent or None)}."""
    rank, world = demo.where()
    ids = demo.tokens(0, 0, rank, world)
    out = {}
    # 1. PyTorch's recipe for fp16: GradScaler around the optimizer the engine steps, on zl.DDP in
    # fp32 (it trains: the optimizer's parameters hold the whole averaged gradients the scaler
    # reads), on ZeRO-2 in fp32 (each rank holds a slice: refused by name) and on an fp16 engine
    # (two scalers on one loss: refused by name)
    for habit, precision, stage in (('GradScaler around zl.DDP, precision="fp32"', "fp32", 0),
                                    ('GradScaler around ZeRO-2, precision="fp32"', "fp32", 2),
                                    ('GradScaler around ZeRO-2, precision="fp16"', "fp16", 2)):
        engine, optimizer = _engine(precision, stage)
        engine.comm.reset()
        scaler = torch.amp.GradScaler("cpu")
        try:
            scaler.scale(engine(input_ids=ids, labels=ids).loss).backward()
            scaler.step(optimizer)
            scaler.update()
            out[habit] = ("trained", _grad_bytes(engine))
        except Exception as e:  # noqa: BLE001 - what a user would see is the point
            out[habit] = (f"{type(e).__name__}: {demo.first_line(e)}", None)
    # 2. zerolab's fp16: the engine scales the loss, unscales, checks for overflow, skips if it must
    engine, _ = _engine("fp16")
    engine.comm.reset()
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    applied = engine.step()
    out['precision="fp16", engine.backward(loss)'] = (f"step applied: {applied}, loss scale {engine.precision.scale:g}",
                                                     _grad_bytes(engine))
    # 3. autocast's bf16 around an fp32 engine, and 4. zerolab's bf16
    for habit, precision, autocast in (("torch.autocast(bf16) around precision=\"fp32\"", "fp32", True),
                                       ('precision="bf16"', "bf16", False)):
        engine, optimizer = _engine(precision)
        engine.comm.reset()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = engine(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        out[habit] = ("trained", _grad_bytes(engine))
    return out


def _generator(stage=3):
    engine, _ = _engine("fp32", stage=stage)
    return engine, engine.module.eval(), demo.probe()[:1, :8]


def sample_alone(timeout: float = 3.0, new_tokens: int = 8):
    """ZeRO-3, rank 0 alone calls Hugging Face's generate (the other ranks are busy past the collective timeout):
    its first forward gathers a unit, a collective no other rank enters. Raises on rank 0."""
    engine, model, prompt = _generator()
    engine.comm.timeout = timeout
    if zl.rank() == 0:
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    else:
        time.sleep(2 * timeout)


def sample_together(new_tokens: int = 8) -> list:
    """Every rank generates inside engine.gathered_parameters(): the whole weights, the same calls on every
    rank. Returns the new tokens (the same on every rank)."""
    engine, model, prompt = _generator()
    with engine.gathered_parameters(), torch.no_grad():
        out = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[0, prompt.shape[1]:].tolist()
