"""Chapter 5: every engine in both modes, against one process.

    runs = engine_runs((2, 4, 8))
    runs["bits"]["default"]["zero3"][4]   # {"numel", "elements", "bits"}: ZeRO-3 on 4 ranks
                                          # against zl.SingleProcess's weights
    runs["bits"]["bitwise"]["ddp"][8]     # {"numel": ..., "elements": 0, "bits": 0}
    runs["norms"]["bitwise"]              # the one-process run's clip norms, step by step

The training is a PyTorch user's loop with gradient accumulation, as nanoGPT writes it: GPT-nano,
fp32 AdamW, a global batch cut into num_chunks chunks; rank r's k-th backward is chunk r*K + k
(K = num_chunks / N backwards per rank), its loss divided by K. Only the last backward is reduced
in the default mode (require_backward_grad_sync, nanoGPT's switch; the bitwise mode accepts it and
changes nothing). Then engine.clip_grad_norm_, optimizer.step() and optimizer.zero_grad(). The same
loop runs in the default mode (bitwise=False) and in the bitwise mode (bitwise=True,
engines.options.BITWISE); each is compared with zl.SingleProcess in the same mode, which runs all
the chunks' backwards itself.
"""

from __future__ import annotations

import functools

import torch

import zerolab as zl
from zerolab.bitwise import differing_bits
from zerolab.data import CharDataset
from zerolab.models import GPT, gpt_config, gpt_loss

ENGINES = {"ddp": "zl.DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3"}
MODES = {"default": False, "bitwise": True}
ADAMW = functools.partial(torch.optim.AdamW, lr=3e-3, weight_decay=0.1)


def build(name: str, model, bitwise: bool):
    """zl.SingleProcess, zl.DDP or zl.ZeRO(stage=k), in the mode asked for."""
    if name == "single":
        return zl.SingleProcess(model, ADAMW, bitwise=bitwise)
    if name == "ddp":
        return zl.DDP(model, ADAMW, bitwise=bitwise)
    return zl.ZeRO(model, ADAMW, stage=int(name[-1]), bitwise=bitwise)


def train(name: str, bitwise: bool, run: dict):
    """run["steps"] steps on this rank. Returns (trainable weights by name, the clip's norms)."""
    n, r = zl.world_size(), zl.rank()
    torch.manual_seed(0)
    cfg = gpt_config(run["size"])
    model, data = GPT(cfg), CharDataset(cfg.block_size)
    engine = build(name, model, bitwise)
    K, per = run["num_chunks"] // n, run["global_rows"] // run["num_chunks"]
    norms = []
    for step in range(run["steps"]):
        x, y = data.global_batch(step, run["global_rows"])
        for k in range(K):
            rows = slice((r * K + k) * per, (r * K + k + 1) * per)
            engine.require_backward_grad_sync = k == K - 1      # nanoGPT's switch: reduce on the last
            _, loss = gpt_loss(engine, (x[rows], y[rows]))
            (loss / K).backward()
        norms.append(engine.clip_grad_norm_(run["max_norm"]))
        engine.optimizer.step()
        engine.optimizer.zero_grad(set_to_none=True)
    trainable = [k for k, p in model.named_parameters() if p.requires_grad]
    full = engine.full_state_dict()           # (every rank takes part: ZeRO-3 gathers)
    return {k: full[k].clone() for k in trainable}, norms


def worker(engines, run: dict):
    """Every engine in both modes on this rank; rank 0 returns the results, the others None."""
    out = {(name, mode): train(name, bitwise, run) for name in engines for mode, bitwise in MODES.items()}
    return out if zl.rank() == 0 else None


def totals(per_tensor: dict) -> dict:
    """differing_bits summed over the tensors: {"numel", "elements", "bits"}."""
    return {key: sum(row[key] for row in per_tensor.values()) for key in ("numel", "elements", "bits")}


def engine_runs(world_sizes=(2, 4, 8), engines=tuple(ENGINES), size: str = "nano", steps: int = 3,
                num_chunks: int = 8, global_rows: int = 16, max_norm: float = 0.3) -> dict:
    """{"bits": {mode: {engine: {N: totals}}}, "norms": {mode: [one process's clip norms]}}, each
    engine at each world size against zl.SingleProcess in the same mode (one launch per N)."""
    run = {"size": size, "steps": steps, "num_chunks": num_chunks, "global_rows": global_rows,
           "max_norm": max_norm}
    one = zl.launch(worker, 1, args=(("single",), run))[0]
    out = {"bits": {mode: {name: {} for name in engines} for mode in MODES},
           "norms": {mode: one["single", mode][1] for mode in MODES}}
    for n in world_sizes:
        results = zl.launch(worker, n, args=(tuple(engines), run))[0]
        for (name, mode), (weights, _) in results.items():
            out["bits"][mode][name][n] = totals(differing_bits(weights, one["single", mode][0]))
    return out
