"""Worker functions for the GPU runs (launched ranks import them from here: gpu.workers).

Every function runs on each rank under zl.launch and returns plain Python / CPU tensors.
On a machine without a GPU they fall back to the CPU, so the scripts can be tried anywhere.
"""

from __future__ import annotations

import time
from functools import partial

import torch
import torch.distributed as dist

import zerolab as zl
from zerolab.bench import deepspeed_config, fsdp2, make_zerolab, torch_ddp
from zerolab.data import CharDataset
from zerolab.models import GPT, GPTConfig, gpt_config, gpt_loss

# the parity tests' settings (tests/test_zero.py)
STEPS = 3
OPT = partial(torch.optim.AdamW, lr=1e-3, eps=1e-6, weight_decay=0.1)
ENGINES = ("zl.DDP", "zl.ZeRO-1", "zl.ZeRO-2", "zl.ZeRO-3", "zl.ZeRO-3 prefetch=0")


def compute_device() -> torch.device:
    """This rank's GPU under NCCL; cuda:0 shared by all ranks under gloo; the CPU without a GPU."""
    if torch.cuda.is_available():
        return zl.device() if zl.device().type == "cuda" else torch.device("cuda", 0)
    return torch.device("cpu")


def backend_name() -> str:
    return str(dist.get_backend())


def make_engine(name, model, precision, bucket_mb, track_peak=False, **kw):
    """zerolab's engine called `name` in the tables (zerolab.bench.ZEROLAB: the CPU bench's names
    too), with the parity tests' AdamW."""
    return make_zerolab(name, model, OPT, precision=precision, bucket_mb=bucket_mb, track_peak=track_peak, **kw)


# ------------------------------------------------------------------ parity


def parity_worker(precisions=("fp32", "bf16"), engines=ENGINES):
    """Each engine, STEPS steps of the nano GPT on this rank's share of the global batch."""
    rank, n = dist.get_rank(), dist.get_world_size()
    dev = compute_device()
    data = CharDataset(32)
    out = {"backend": backend_name(), "device": str(dev), "runs": {}}
    for precision in precisions:
        for name in engines:
            key = f"{name} {precision}"
            try:
                torch.manual_seed(0 if rank == 0 else 100 + rank)   # the broadcast must fix rank > 0
                model = GPT(gpt_config("nano", bias=False)).to(dev)
                eng = make_engine(name, model, precision, bucket_mb=0.02)
                losses = []
                for s in range(STEPS):
                    x, y = (t.to(dev) for t in data.batch(s, 2, rank, n))
                    _, loss = gpt_loss(eng, (x, y))
                    eng.backward(loss)
                    eng.step()
                    eng.zero_grad()
                    losses.append(loss.item())
                sd = {k: v.detach().float().cpu() for k, v in eng.full_state_dict().items()}
                out["runs"][key] = {"ok": True, "state": sd, "losses": losses}
            except Exception as e:  # noqa: BLE001 - recorded: what runs and what does not
                out["runs"][key] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:400]}"}
            finally:
                torch.cuda.synchronize() if dev.type == "cuda" else None
    return out


def reference_state(n, precision, dev):
    """One process, the global batch: plain torch in fp32, zl.SingleProcess in bf16."""
    torch.manual_seed(0)
    model = GPT(gpt_config("nano", bias=False)).to(dev)
    data = CharDataset(32)
    if precision == "fp32":
        opt = OPT(model.parameters())
        for s in range(STEPS):
            x, y = (t.to(dev) for t in data.batch(s, 2 * n))
            gpt_loss(model, (x, y))[1].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    eng = zl.SingleProcess(model, OPT, precision=precision, track_peak=False)
    for s in range(STEPS):
        x, y = (t.to(dev) for t in data.batch(s, 2 * n))
        eng.backward(gpt_loss(eng, (x, y))[1])
        eng.step()
        eng.zero_grad()
    return {k: v.detach().float().cpu() for k, v in eng.full_state_dict().items()}


def collectives_probe():
    """Which collectives this process group runs on CUDA tensors (gloo's CUDA support is partial)."""
    dev = compute_device()
    n = dist.get_world_size()
    out = {"backend": backend_name(), "device": str(dev)}
    tests = {
        "all_reduce": lambda: dist.all_reduce(torch.ones(8, device=dev)),
        "broadcast": lambda: dist.broadcast(torch.ones(8, device=dev), 0),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty(8 * n, device=dev),
                                                                      torch.ones(8, device=dev)),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.empty(8, device=dev),
                                                                    torch.ones(8 * n, device=dev)),
        "all_reduce on a CPU tensor": lambda: dist.all_reduce(torch.ones(8)),
    }
    for name, fn in tests.items():
        try:
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            out[name] = "ok"
        except Exception as e:  # noqa: BLE001
            out[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return out


# ------------------------------------------------------------------ the bench


def bench_cfg(name: str) -> GPTConfig:
    """The models of the GPU bench: GPT-2 medium-like (~406 M params) and GPT-2 small-like (~163 M)."""
    if name == "350m":
        return GPTConfig(vocab_size=50304, block_size=1024, n_layer=24, n_head=16, n_embd=1024)
    if name == "124m":
        return GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    if name == "cpu-test":   # for trying the scripts on a CPU
        return GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=2, n_embd=64)
    raise ValueError(name)


def _batch(cfg, step, batch, rank, n, dev):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, cfg.vocab_size, (batch * n, cfg.block_size + 1), generator=g)
    x = x[rank * batch:(rank + 1) * batch]
    return x[:, :-1].to(dev, non_blocking=True), x[:, 1:].to(dev, non_blocking=True)


def _peer(name, model, bucket_mb, dev):
    """PyTorch peers in bf16, matched to zerolab's bf16 (compute and communication in bf16 where
    the API allows): DDP under autocast (its params/grads stay fp32: autocast is PyTorch DDP's
    bf16), FSDP2 with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)."""
    if name == "PyTorch DDP":
        m = torch_ddp(model, bucket_mb, dev)
        opt = torch.optim.AdamW(m.parameters(), lr=3e-4)
        return m, opt, True
    model = fsdp2(model, reshard=name.endswith("True"), device_type=dev.type, bf16=True)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-4), False


def _deepspeed(stage, model, batch, bucket_mb):
    import deepspeed
    cfg = deepspeed_config(stage, batch, bucket_mb, bf16=True, overlap=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    eng, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return eng


BENCH_ENGINES = ("zl.DDP", "zl.ZeRO-1", "zl.ZeRO-2", "zl.ZeRO-3", "zl.ZeRO-3 prefetch=0",
                 "PyTorch DDP", "FSDP2 reshard=False", "FSDP2 reshard=True",
                 "DeepSpeed ZeRO-1", "DeepSpeed ZeRO-2", "DeepSpeed ZeRO-3")


def bench_worker(cfg_name, batch, bucket_mb, warmup, steps, engines=BENCH_ENGINES):
    """Each engine built ALONE (fresh allocator stats), warmed up, then timed with CUDA events.

    Time: median step (forward, backward, step, zero_grad), synchronised. Memory, every figure taken
    after gpu.common.settle (garbage collected, GPU idle), against the allocator's level when no
    engine is alive: the lower of its level before the engine was built and after it was deleted
    (a previous engine whose buffers are freed only during this one's run moves the first; this
    one's leftovers would move the second; both are recorded, as leftover_bytes and after_bytes,
    beside the level at the bench's start). held: allocated when a step begins (gradients freed by
    zero_grad); peak: torch.cuda.max_memory_allocated over the timed steps; state_bytes: the model
    states counted storage by storage (gpu.common.state_bytes), None where they cannot be reached.
    """
    from gpu.common import settle, state_bytes
    rank, n = dist.get_rank(), dist.get_world_size()
    dev = compute_device()
    cfg = bench_cfg(cfg_name)
    cuda = dev.type == "cuda"
    rows = {}
    start = settle(dev) if cuda else None
    for name in engines:
        row = {"engine": name}
        base = settle(dev) if cuda else None
        try:
            torch.manual_seed(0)
            model = GPT(cfg).to(dev)
            psi = sum(p.numel() for p in model.parameters())
            autocast, counted = False, {}
            if name.startswith("zl."):
                eng = make_engine(name, model, "bf16", bucket_mb)
                fwd, bwd, stp = eng, eng.backward, eng.step
                counted = {"engine": eng}

                def zero():
                    eng.zero_grad()
            elif name.startswith("DeepSpeed"):
                eng = _deepspeed(int(name[-1]), model, batch, bucket_mb)
                fwd, bwd, stp = eng, eng.backward, eng.step

                def zero():
                    pass
            else:
                m, opt, autocast = _peer(name, model, bucket_mb, dev)
                fwd, bwd, stp = m, (lambda loss: loss.backward()), opt.step
                counted = {"module": m, "optimizer": opt}

                def zero():
                    opt.zero_grad(set_to_none=True)
            del model

            def one(step):
                x, y = _batch(cfg, step, batch, rank, n, dev)
                with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
                    _, loss = gpt_loss(fwd, (x, y))
                bwd(loss)
                stp()
                zero()
                return loss.item()
            for s in range(warmup):
                one(s)
            dist.barrier()
            held = settle(dev, empty_cache=False) if cuda else None
            state = state_bytes(**counted) if counted else None
            if cuda:
                torch.cuda.reset_peak_memory_stats(dev)
            times = []
            for s in range(warmup, warmup + steps):
                dist.barrier()
                if cuda:
                    torch.cuda.synchronize()
                t = time.perf_counter()
                loss = one(s)       # a float: no tensor of this engine outlives its row
                if cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
            row.update(ok=True, psi=psi, times=times, loss=loss, held_abs=held, state_bytes=state,
                       peak_abs=torch.cuda.max_memory_allocated(dev) if cuda else None,
                       reserved_peak=torch.cuda.max_memory_reserved(dev) if cuda else None)
            del fwd, bwd, stp, zero, one, counted
            eng = m = opt = None      # noqa: F841 - drop the engine before the next one is measured
        except Exception as e:  # noqa: BLE001 - a peer that cannot run here is reported, not fatal
            import traceback
            row.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
                       where=traceback.format_exc()[-1200:])
        if cuda:
            after = settle(dev)
            row.update(leftover_bytes=base - start, after_bytes=after - start)
            if row["ok"]:
                empty = min(base, after)
                row.update(held=row["held_abs"] - empty, peak=row["peak_abs"] - empty)
        else:
            row.update(held=None, peak=None)
        rows[name] = row
    return {"backend": backend_name(), "device": str(dev), "rows": rows}


# ------------------------------------------------------------------ memory snapshot (M_D)


def memsnap_worker(cfg_name, batch, snapshot_path, checkpoint_activations=True, steps=3):
    """ZeRO-3 bf16 steps under the CUDA allocator's history recorder, and the same step's
    allocation trace (zerolab.memory.AllocationTracker) replayed in chapter 9's allocator model."""
    from zerolab.theory import allocator
    from zerolab.memory import AllocationTracker
    rank, n = dist.get_rank(), dist.get_world_size()
    dev = compute_device()
    cuda = dev.type == "cuda"
    cfg = bench_cfg(cfg_name)
    torch.manual_seed(0)
    eng = zl.ZeRO(GPT(cfg).to(dev), OPT, stage=3, precision="bf16", track_peak=False,
                  checkpoint_activations=checkpoint_activations, track_activations=False)

    def one(s):
        _, loss = gpt_loss(eng, _batch(cfg, s, batch, rank, n, dev))
        eng.backward(loss)
        eng.step()
        eng.zero_grad()
    one(0)                                # first step: optimizer state is created
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
        try:   # alloc/free events only: no stack traces (cheap, and a small snapshot)
            torch.cuda.memory._record_memory_history(max_entries=200000, context=None, stacks="python")
        except Exception:  # noqa: BLE001 - older signatures
            torch.cuda.memory._record_memory_history(max_entries=200000)
    for s in range(1, steps):
        one(s)
    out = {"backend": backend_name(), "device": str(dev), "checkpoint_activations": checkpoint_activations}
    if cuda:
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        if snapshot_path:
            import pickle
            with open(snapshot_path, "wb") as f:
                pickle.dump(snap, f)
        stats = torch.cuda.memory_stats(dev)
        segs = snap["segments"]
        free_blocks = [b["size"] for s_ in segs for b in s_["blocks"] if b["state"] == "inactive"]
        out["cuda"] = {
            "allocated_peak": stats["allocated_bytes.all.peak"], "reserved_peak": stats["reserved_bytes.all.peak"],
            "active_peak": stats["active_bytes.all.peak"],
            "inactive_split_peak": stats["inactive_split_bytes.all.peak"],
            "num_alloc_retries": stats["num_alloc_retries"], "num_ooms": stats["num_ooms"],
            "segments_end": len(segs), "reserved_end": sum(s_["total_size"] for s_ in segs),
            "allocated_end": sum(s_["allocated_size"] for s_ in segs),
            "free_in_segments_end": sum(free_blocks), "largest_free_block_end": max(free_blocks, default=0),
            "free_blocks_end": len(free_blocks),
            "segment_sizes_end": sorted((s_["total_size"] for s_ in segs), reverse=True)[:40],
        }
        # the timeline: allocated bytes after each alloc/free of the recorded steps, and reserved
        tl, alloc, reserved = [], 0, 0
        for ev in snap["device_traces"][dev.index or 0]:
            a, size = ev["action"], ev["size"]
            if a == "alloc":
                alloc += size
            elif a == "free_completed":
                alloc -= size
            elif a == "segment_alloc":
                reserved += size
            elif a == "segment_free":
                reserved -= size
            else:
                continue
            tl.append((alloc, reserved))
        out["cuda"]["timeline"] = tl[:: max(1, len(tl) // 3000)]
        out["cuda"]["timeline_events"] = len(tl)
        out["cuda"]["note"] = ("timeline: allocated bytes (alloc / free_completed) and segment bytes "
                               "(segment_alloc / segment_free) RELATIVE to the start of recording; "
                               "the steps before recording had already reserved segments")
        out["cuda"]["start_allocated"] = None
    # the same step again, followed op by op, replayed in chapter 9's allocator model
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
        before_alloc = torch.cuda.memory_allocated(dev)
        before_res = torch.cuda.memory_reserved(dev)
    with AllocationTracker(record_trace=True) as tr:
        one(steps)
    trace = tr.trace
    life = allocator.lifetimes(trace)
    longl = allocator.long_lived(trace)
    plain = allocator.replay(trace)
    md = allocator.replay(trace, defragment=longl)
    out["model"] = {"events": len(trace), "blocks": len(life), "long_lived_blocks": len(longl),
                    "without_MD": plain.__dict__ | {"fragmentation": plain.fragmentation},
                    "with_MD": md.__dict__ | {"fragmentation": md.fragmentation},
                    "note": "zerolab.theory.allocator.replay (best-fit, coalescing, 512-byte rounding) of the "
                            "step's op-level allocation trace; long-lived = alive > 25% of the step or "
                            "past its end (zerolab.theory.allocator.long_lived), the blocks M_D would move"}
    if cuda:
        torch.cuda.synchronize()
        st = torch.cuda.memory_stats(dev)
        out["traced_step_cuda"] = {"allocated_at_start": before_alloc, "reserved_at_start": before_res,
                                   "allocated_peak": st["allocated_bytes.all.peak"],
                                   "reserved_peak": st["reserved_bytes.all.peak"]}
    with torch.device("meta"):
        out["psi"] = sum(p.numel() for p in GPT(cfg).parameters())
    return out


# ------------------------------------------------------------------ profiler traces


def profile_worker(cfg_name, batch, trace_dir, engines=("zl.DDP", "zl.ZeRO-3", "zl.ZeRO-3 prefetch=0", "PyTorch DDP")):
    """Two profiled steps per engine (after two warm-ups); returns each kernel's (name, stream,
    start, duration) for the last step, and the ledger's records, for a summary in the parent."""
    from torch.profiler import ProfilerActivity, profile
    rank, n = dist.get_rank(), dist.get_world_size()
    dev = compute_device()
    cuda = dev.type == "cuda"
    cfg = bench_cfg(cfg_name)
    res = {"backend": backend_name(), "device": str(dev), "engines": {}}
    for name in engines:
        torch.manual_seed(0)
        model = GPT(cfg).to(dev)
        autocast = False
        if name.startswith("zl."):
            eng = make_engine(name, model, "bf16", 25.0)
            fwd, bwd, stp, zero = eng, eng.backward, eng.step, eng.zero_grad
        else:
            m, opt, autocast = _peer(name, model, 25.0, dev)
            fwd, bwd, stp, zero = m, (lambda loss: loss.backward()), opt.step, (lambda: opt.zero_grad(set_to_none=True))

        def one(s):
            x, y = _batch(cfg, s, batch, rank, n, dev)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
                _, loss = gpt_loss(fwd, (x, y))
            bwd(loss)
            stp()
            zero()
        for s in range(2):
            one(s)
        if cuda:
            torch.cuda.synchronize()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            for s in range(2, 4):
                with torch.profiler.record_function(f"step{s}"):
                    one(s)
            if cuda:
                torch.cuda.synchronize()
        if trace_dir and rank == 0:
            import os
            prof.export_chrome_trace(os.path.join(trace_dir, name.replace(" ", "_").replace("=", "") + ".json"))
        events = []
        steps = []
        for e in prof.events():
            if e.name == "step3" and e.device_type.name == "CPU":
                steps.append((e.time_range.start, e.time_range.end))
            if e.device_type.name == "CUDA":
                events.append((e.name[:120], getattr(e, "device_resource_id", 0), e.time_range.start,
                               e.time_range.end - e.time_range.start))
        res["engines"][name] = {"kernels": events, "step_cpu_range": steps[:1]}
        del fwd, bwd, stp, zero, one, model
        try:
            del eng
        except NameError:
            pass
        try:
            del m, opt
        except NameError:
            pass
        import gc
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return res


# ------------------------------------------------------------------ ZeRO-R offload over PCIe


def pcie_bandwidth(nbytes=1 << 30, reps=5):
    """Pinned host <-> device copy rates (bytes/s), median of `reps` after one warm-up."""
    if not torch.cuda.is_available():
        return None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for name, dst, src in (("host_to_device", dev, host), ("device_to_host", host, dev)):
        times = []
        for i in range(reps + 1):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            dst.copy_(src, non_blocking=True)
            e.record()
            e.synchronize()
            if i:
                times.append(s.elapsed_time(e) / 1e3)
        times.sort()
        out[name] = nbytes / times[len(times) // 2]
    return out


OFFLOAD_CONFIGS = {"no checkpointing": {}, "checkpointing": {"checkpoint_activations": True},
                   "P_a": {"checkpoint_activations": True, "partition_activations": True},
                   "P_a+cpu (offload)": {"checkpoint_activations": True, "partition_activations": True,
                                         "offload_activations": True}}


def offload_worker(cfg_name, batch, warmup=2, steps=5, stage=2):
    """ZeRO-2 bf16 with ZeRO-R's activation options: step time, peak memory, bytes offloaded."""
    import gc
    rank, n = dist.get_rank(), dist.get_world_size()
    dev = compute_device()
    cuda = dev.type == "cuda"
    cfg = bench_cfg(cfg_name)
    out = {"backend": backend_name(), "device": str(dev), "world_size": n,
           "pcie": pcie_bandwidth() if cuda and rank == 0 else None, "rows": {}}
    for name, kw in OFFLOAD_CONFIGS.items():
        row = {}
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated(dev)
        try:
            torch.manual_seed(0)
            if n == 1:
                if kw.get("partition_activations"):
                    continue          # P_a needs a model-parallel group (mp >= 2)
                mesh, model = None, GPT(cfg)
            else:                     # all ranks in one mp group: tensor parallel blocks
                from zerolab.tensor_parallel import TensorParallelGPT
                mesh = zl.Mesh(dp=1, mp=n)
                model = TensorParallelGPT.from_dense(GPT(cfg), mesh)
            eng = zl.ZeRO(model.to(dev), OPT, stage=stage, precision="bf16", track_peak=False,
                          mesh=mesh, track_activations=False, **kw)
            del model

            ck = getattr(eng, "checkpointing", None)
            sent = []

            def one(s):
                # the mp ranks of a group see the same sequences (dp = 1 here: all of them)
                dp_rank, dp = (rank, n) if mesh is None else (mesh.dp_rank, mesh.dp)
                _, loss = gpt_loss(eng, _batch(cfg, s, batch, dp_rank, dp, dev))
                sent.append(getattr(ck, "offloaded_bytes", 0) if ck is not None else 0)   # after this forward
                eng.backward(loss)
                eng.step()
                eng.zero_grad()
            for s in range(warmup):
                one(s)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(dev)
            times = []
            for s in range(warmup, warmup + steps):
                if cuda:
                    torch.cuda.synchronize()
                t = time.perf_counter()
                one(s)
                if cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
            row.update(ok=True, step_ms=sorted(times)[len(times) // 2] * 1e3, times=times,   # in step order
                       peak=(torch.cuda.max_memory_allocated(dev) - base) if cuda else None,
                       offloaded_bytes_per_step=sent[-1] - sent[-2])   # the counter only grows
            del eng, one
        except Exception as e:  # noqa: BLE001
            row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
        out["rows"][name] = row
    return out


# ------------------------------------------------------------------ overlap and prefetch, measured by the ledger


def ddp_overlap_worker(cfg_name, batch, bucket_mb=25.0, warmup=2, steps=5, precision="bf16"):
    """Chapter 5's three DDPs (naive, bucketed, overlapped) on CUDA tensors: median step, and in
    the last step how much of the gradient communication ran before backward's compute ended
    (zerolab.book.timeline.overlap_fraction over the ledger's records, host clock)."""
    from zerolab.engines.ddp import DDP
    from zerolab.engines.naive_ddp import NaiveDDP
    from zerolab.book.timeline import overlap_fraction
    rank, n = dist.get_rank(), dist.get_world_size()
    dev = compute_device()
    cuda = dev.type == "cuda"
    cfg = bench_cfg(cfg_name)
    out = {"backend": backend_name(), "device": str(dev), "rows": {}}
    for mode in ("naive", "bucketed", "overlapped"):
        torch.manual_seed(0)
        model = GPT(cfg).to(dev)
        eng = (NaiveDDP(model, OPT, precision=precision, track_peak=False) if mode == "naive" else
               DDP(model, OPT, precision=precision, bucket_mb=bucket_mb, track_peak=False,
                   overlap=(mode == "overlapped")))
        times = []
        for i in range(warmup + steps):
            dist.barrier()
            if cuda:
                torch.cuda.synchronize()
            eng.comm.reset()
            t0 = eng.comm.now()
            _, loss = gpt_loss(eng, _batch(cfg, i, batch, rank, n, dev))
            eng.backward(loss)
            eng.step()
            eng.zero_grad()
            if cuda:
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(eng.comm.now() - t0)
        lb = eng.last_backward
        comm = [(c.start, c.end, c.tag) for c in eng.comm.records if c.tag.startswith(("bucket", "grad"))]
        times.sort()
        out["rows"][mode] = {"step_s": times[len(times) // 2], "calls": len(comm),
                             "overlap": overlap_fraction(comm, lb["compute_end"]),
                             "wait_after_backward_s": lb["end"] - lb["compute_end"]}
        del eng, model
    return out


def prefetch_worker(cfg_name, batch, warmup=2, steps=8):
    """Chapter 8's prefetch timing on CUDA tensors: ZeRO-3 prefetch=0 and 1 interleaved step by
    step (alternating order), synchronised; the seconds each step spent blocked in all-gather waits."""
    from zerolab.engines.zero3 import ZeRO3
    rank, n = dist.get_rank(), dist.get_world_size()
    dev = compute_device()
    cuda = dev.type == "cuda"
    cfg = bench_cfg(cfg_name)
    engines = {}
    for pf in (0, 1):
        torch.manual_seed(0)
        engines[pf] = ZeRO3(GPT(cfg).to(dev), OPT, precision="bf16", prefetch=pf, track_peak=False)
    times, waits = {0: [], 1: []}, {0: [], 1: []}
    for s in range(warmup + steps):
        b = _batch(cfg, s, batch, rank, n, dev)
        for pf in ((0, 1) if s % 2 == 0 else (1, 0)):
            eng = engines[pf]
            dist.barrier()
            if cuda:
                torch.cuda.synchronize()
            w0, t0 = eng.gather_wait_s, time.perf_counter()
            eng.backward(gpt_loss(eng, b)[1])
            eng.step()
            eng.zero_grad()
            if cuda:
                torch.cuda.synchronize()
            if s >= warmup:
                times[pf].append(time.perf_counter() - t0)
                waits[pf].append(eng.gather_wait_s - w0)
    return {"backend": backend_name(), "device": str(dev), "times": times, "waits": waits}
