"""Chapter 10's measured scaling: every stage at N = 1, 2, 4 on this machine.

`scaling_worker` builds DDP (stage 0) and ZeRO stages 1-3 on the same model in the same ranks,
trains each a few steps in turn, and reports per stage the model-state bytes this rank holds
(measured storages, `memory_report`), the peak of one step above that, and the bytes the ledger
booked for one step. The parent compares them with the formulas. Nothing here is timed: on a
machine whose ranks share a few cores, step times say how the ranks queue for the cores, not
how the stages scale; the benchmark (zerolab.bench) times the engines with their spread.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from .. import engines
from ..data import CharDataset
from ..memory import model_state_bytes
from ..models import GPT, gpt_config, gpt_loss, num_params

OPT = partial(torch.optim.AdamW, lr=3e-4)
STAGES = (0, 1, 2, 3)


def _engine(stage, size, bucket_mb):
    torch.manual_seed(0)
    model = GPT(gpt_config(size))
    return engines.make("ddp" if stage == 0 else f"zero{stage}", model, OPT, bucket_mb=bucket_mb,
                        track_peak=True)      # the step's peak is one of the columns


def scaling_worker(size="tiny", batch=2, steps=4, bucket_mb=0.25):
    """Per stage on this rank: model-state bytes, step peak, ledger bytes of one step, loss."""
    rank, n = dist.get_rank(), dist.get_world_size()
    data = CharDataset(gpt_config(size).block_size)
    engines = {s: _engine(s, size, bucket_mb) for s in STAGES}
    out = {}
    for i in range(steps):
        for s in STAGES:
            eng = engines[s]
            eng.comm.reset()
            _, loss = gpt_loss(eng, data.batch(i, batch, rank, n))
            eng.backward(loss)
            eng.step()
            if i == steps - 1:   # after the last step, gradients still held (stage 2/3 hold shards)
                rep = eng.memory_report()
                out[s] = {"states": rep["total"], "peak": rep["peak"], "comm": eng.comm.bytes(),
                          "loss": loss.item()}
            eng.zero_grad()
    return out


def formula_bytes(psi: int, n: int, stage: int) -> float:
    """fp32 training with Adam: 4 + 4 bytes of parameter and gradient, K = 8 (two moments)."""
    return model_state_bytes(psi, n, stage, k=8, param_bytes=4, grad_bytes=4)


def comm_formula_bytes(psi: int, n: int, stage: int) -> float:
    """Ring-model bytes per rank per step: 2(N-1)/N * 4 psi for DDP, ZeRO-1 (all-reduce + gather
    counted as in zerolab: reduce-scatter + all-gather) and ZeRO-2; 3(N-1)/N * 4 psi for ZeRO-3."""
    factor = 3 if stage == 3 else 2
    return factor * (n - 1) / n * 4 * psi


def run_scaling(world_sizes=(1, 2, 4), size="tiny", batch=2, steps=4):
    """Launch once per world size; returns {n: {stage: measurements}} and the parameter count."""
    from ..launch import launch
    psi = num_params(GPT(gpt_config(size)))
    results = {}
    for n in world_sizes:
        ranks = launch(scaling_worker, n, args=(size, batch, steps))
        results[n] = {s: {"states": max(r[s]["states"] for r in ranks),
                          "peak": max(r[s]["peak"] for r in ranks),
                          "comm": max(r[s]["comm"] for r in ranks),
                          "loss": sum(r[s]["loss"] for r in ranks) / n} for s in STAGES}
    return results, psi
