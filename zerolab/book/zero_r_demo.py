"""Workers and measurements for chapter 9 (ZeRO-R). Every number the chapter prints comes from here.

The launched functions (mesh_runs, buffer_curve, recompute_work) run on every rank and return
plain values; the parent prints them in rank order.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

import zerolab as zl
from ..theory import allocator
from .. import memory
from ..zero_r import activation_checkpointing as checkpointing
from ..data import CharDataset
from ..zero_r.mesh import Mesh
from ..models import GPT, gpt_config, gpt_loss
from ..zero_r.tensor_parallel import TensorParallelGPT

B = 4
MODES = {"none": {}, "ckpt": dict(checkpoint_activations=True),
         "pa": dict(checkpoint_activations=True, partition_activations=True),
         "pa_cpu": dict(checkpoint_activations=True, partition_activations=True, offload_activations=True)}
# The paper's Table 3: every configuration uses C_B and M_D (and activation checkpointing)
CONFIGS = {"C1": (1, "ckpt"), "C2": (1, "pa"), "C3": (2, "ckpt"), "C4": (2, "pa"), "C5": (2, "pa_cpu")}


def _cfg(n_layer=4):
    return gpt_config("nano", n_head=4, n_layer=n_layer)


# ------------------------------------------------------------------ 1. residual states, one process


def residual_states(n_layer: int = 4, batch: int = 8) -> dict:
    """Bytes of one plain training step of the GPT (AdamW, fp32), all MEASURED.

    model states (live storages), activations (what forward leaves for backward), temporary
    buffers (the step's peak above those two), fragmentation (the allocator model's reserved
    bytes above the peak, replaying the step's real allocation trace).
    """
    torch.manual_seed(0)
    cfg = _cfg(n_layer)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = CharDataset(cfg.block_size)
    for s in range(2):                     # step 0 creates Adam's state; step 1 is measured
        model.zero_grad(set_to_none=True)
        with memory.AllocationTracker(record_trace=True) as tr:
            _, loss = gpt_loss(model, data.batch(s, batch))
            act = tr.current               # what forward left alive for backward
            with memory.AllocationTracker() as bwd:
                loss.backward()
            with memory.AllocationTracker() as upd:
                opt.step()
            end = len(tr.trace)
        trace = tr.trace[:end]
    states = memory.model_state_bytes_measured(model, opt)   # params, grads, optimizer: all live
    replayed = allocator.replay(trace)
    # temporaries: what backward allocated beyond the gradients it leaves, and the optimizer's scratch
    temporary = max(bwd.peak - bwd.current, upd.peak - upd.current)
    return {"model states": states["total"], "activations": act, "temporary buffers": temporary,
            "fragmentation": replayed.reserved - replayed.peak_live}


# ------------------------------------------------------------------ 2. M_D on a real trace


def step_trace(n_layer: int = 4, batch: int = 8):
    """The allocation trace of one checkpointed training step, and which blocks M_D would move.

    M_D (the paper, section 6.3) copies activation checkpoints and parameter gradients into
    pre-allocated contiguous buffers as they are produced. In the trace those are the blocks
    made in forward that outlive it (checkpoints) and the blocks made in backward still alive
    when the step ends (gradients).
    """
    torch.manual_seed(0)
    cfg = _cfg(n_layer)
    model = GPT(cfg)
    checkpointing.enable(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = CharDataset(cfg.block_size)
    for s in range(2):
        with memory.AllocationTracker(record_trace=True) as tr:
            _, loss = gpt_loss(model, data.batch(s, batch))
            end_forward = len(tr.trace)
            loss.backward()
            opt.step()
            end = len(tr.trace)
        trace = tr.trace[:end]          # frees after the step (zero_grad) are not part of it
        opt.zero_grad(set_to_none=True)
    life = allocator.lifetimes(trace)
    checkpoints = {b for b, (a, f, _) in life.items() if a < end_forward and (f is None or f > end_forward)}
    grads = {b for b, (a, f, _) in life.items() if a >= end_forward and f is None}
    return trace, checkpoints, grads


def defrag_table(n_layer: int = 4, batch: int = 8, capacities=(1.0, 1.05, 1.10, 1.20)) -> dict:
    """The allocator model without and with M_D, on the same real trace."""
    trace, checkpoints, grads = step_trace(n_layer, batch)
    out = {"events": len(trace), "checkpoints": len(checkpoints), "grads": len(grads)}
    for name, moved in (("without M_D", None), ("with M_D", checkpoints | grads)):
        r = allocator.replay(trace, defragment=moved)
        runs = {c: allocator.replay(trace, defragment=moved, capacity=int(c * r.peak_live)).failed_at is None
                for c in capacities}
        out[name] = {"peak_live": r.peak_live, "reserved": r.reserved, "stranded": r.stranded,
                     "fragmentation": r.fragmentation, "runs_at": runs}
    return out


# ------------------------------------------------------------------ 3. the mesh runs (world 4)


def _run(mesh, stage, mode, steps=1, n_layer=4):
    torch.manual_seed(0)
    model = TensorParallelGPT.from_dense(GPT(_cfg(n_layer)), mesh)
    eng = zl.ZeRO(model, partial(torch.optim.AdamW, lr=1e-3), stage=stage, mesh=mesh, bucket_mb=0.05,
                  **MODES[mode])
    data = CharDataset(model.cfg.block_size)
    for s in range(steps):
        mesh.ledger.reset()
        if eng.activation_checkpointing is not None:
            eng.activation_checkpointing.reset_counters()
        _, loss = gpt_loss(eng, data.batch(s, B, mesh.dp_rank, mesh.dp))
        pool = eng.activation_checkpointing.kept_bytes() if mode == "pa_cpu" else 0   # slices in the CPU pool now
        eng.backward(loss)
        eng.step()
        if s == steps - 1:
            report = eng.memory_report()
        eng.zero_grad()
    by_tag = {}
    for r in mesh.ledger.records:
        by_tag[r.tag] = by_tag.get(r.tag, 0) + r.bytes_sent
    report["offloaded"] = pool
    report["device_activations"] = report["activations"] - pool
    return {"memory": report, "bytes": by_tag, "loss": round(loss.item(), 4)}


def block_input(mesh):
    """The input of block 1 on this rank, and the slice P_a keeps of it (real tensors)."""
    torch.manual_seed(0)
    model = TensorParallelGPT.from_dense(GPT(_cfg(2)), mesh)
    policy = checkpointing.enable(model, mesh, partition_activations=True)
    seen = {}
    model.blocks[1].register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0].detach().clone()))
    _, loss = gpt_loss(model, CharDataset(model.cfg.block_size).batch(0, 1))
    kept = policy.kept[1].clone()
    loss.backward()
    return {"x": seen["x"][0], "kept": kept}


def mesh_runs() -> dict:
    """Every world-4 measurement of the chapter, in one launch."""
    out = {}
    mesh22 = Mesh(dp=2, mp=2)
    mesh14 = Mesh(dp=1, mp=4)
    out["input"] = block_input(mesh22)
    for mode in MODES:
        out[("mp2", mode)] = _run(mesh22, 2, mode)
    for mode in ("ckpt", "pa", "pa_cpu"):
        out[("mp4", mode)] = _run(mesh14, 2, mode)
    for name, (stage, mode) in CONFIGS.items():
        out[name] = out[("mp2", mode)] if stage == 2 else _run(mesh22, stage, mode)
    out["layout"] = (mesh22.dp_rank, mesh22.mp_rank, mesh22.mp_ranks, mesh22.dp_ranks)
    return out


# ------------------------------------------------------------------ 4. C_B (world 2)


def buffer_curve(n_layers=(1, 2, 4, 8), bucket_mb: float = 0.05) -> list:
    """Stage 2's largest communication-buffer pool in one backward, bucketed vs fused."""
    rank, n = dist.get_rank(), dist.get_world_size()
    rows = []
    for layers in n_layers:
        cfg = gpt_config("nano", n_layer=layers)
        data = CharDataset(cfg.block_size)
        row = {}
        for name, mb in (("bucketed", bucket_mb), ("fused", 1e6)):   # 1e6 MB: everything in one bucket
            torch.manual_seed(0)
            model = GPT(cfg)
            eng = zl.ZeRO(model, partial(torch.optim.AdamW, lr=1e-3), stage=2, bucket_mb=mb, track_peak=False)
            eng.backward(gpt_loss(eng, data.batch(0, 2, rank, n))[1])
            row[name] = eng.max_buffer_bytes
        row["psi"] = sum(p.numel() for p in model.parameters())
        rows.append(row)
    return rows


# ------------------------------------------------------------------ 5. what recomputation costs (exact counts)


def _linear_flops(counter) -> int:
    """FLOPs of the matrix products of linear layers (aten.mm / aten.addmm) a FlopCounterMode saw.

    Attention's own products are left out on purpose: which kernel runs them (and whether the
    flop counter knows that kernel) depends on the machine; the linear layers' do not.
    """
    ops = counter.get_flop_counts().get("Global", {})
    return sum(n for op, n in ops.items() if str(op).split(".")[-1] in ("mm", "addmm"))


def recompute_work(n_layer: int = 4) -> dict:
    """The work each activation option adds to a training step, counted exactly, on this rank.

    For plain stage 2, checkpointing, P_a and P_a+cpu on the tensor-parallel GPT (dp=2 x mp=2):
    how many block forwards start in one step (a forward pre-hook on every block: a recompute
    starts one too), the linear layers' FLOPs in forward and in backward (torch.utils.flop_counter),
    the bytes P_a's all-gathers send (the ledger), and the bytes P_a+cpu copies to the host pool
    (and back, the same again). Counts, not seconds: they are the same on any machine, where a
    timing on a shared 2-core machine mostly measures its neighbours.
    """
    from torch.utils.flop_counter import FlopCounterMode
    mesh = Mesh(dp=2, mp=2)
    data = CharDataset(_cfg().block_size)
    out = {}
    for mode in MODES:
        torch.manual_seed(0)
        model = TensorParallelGPT.from_dense(GPT(_cfg(n_layer)), mesh)
        eng = zl.ZeRO(model, partial(torch.optim.AdamW, lr=1e-3), stage=2, mesh=mesh,
                      track_peak=False, track_activations=False, **MODES[mode])
        starts = [0]
        for block in model.blocks:
            block.register_forward_pre_hook(lambda *_: starts.__setitem__(0, starts[0] + 1))
        for s in range(2):                         # step 0 warms up; step 1 is counted
            starts[0] = 0
            mesh.ledger.reset()
            if eng.activation_checkpointing is not None:
                eng.activation_checkpointing.reset_counters()
            batch = data.batch(s, B, mesh.dp_rank, mesh.dp)
            with FlopCounterMode(display=False) as fwd:
                _, loss = gpt_loss(eng, batch)
            in_forward = starts[0]
            with FlopCounterMode(display=False) as bwd:
                eng.backward(loss)
            eng.step()
            eng.zero_grad()
        policy = eng.activation_checkpointing
        out[mode] = {"block_forwards": starts[0], "in_forward": in_forward,
                     "forward_flops": _linear_flops(fwd), "backward_flops": _linear_flops(bwd),
                     "pa_gather_sent": sum(r.bytes_sent for r in mesh.ledger.records if r.tag == "pa_gather"),
                     "offloaded": policy.offloaded_bytes if policy else 0}
    return out
