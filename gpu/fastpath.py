"""Each side's fast path on one GPU: zerolab, PyTorch DDP, FSDP2 and DeepSpeed, eager and compiled.

    python -m gpu.fastpath OUTDIR eager|compiled [--only PREFIX]   # e.g. --only DeepSpeed

World 1 on NCCL, the ~406 M GPT of gpu.bench (GPT-2 medium shape) in bf16, 8 sequences of 1,024
tokens a step. Unlike gpu.bench, every side runs the way its users run it fast:

* the optimizer is AdamW with fused=True (one CUDA kernel for all tensors) for zerolab and the
  PyTorch engines; DeepSpeed builds its own from the config ("optimizer": AdamW), which is its
  compiled FusedAdam op (built on the machine with ninja and nvcc; the row says if it could not);
* "compiled": torch.compile(model) before zerolab wraps it (ZeRO-3 then compiles it unit by unit),
  around the wrapper for PyTorch DDP (its DDPOptimizer splits the graph at buckets), and after
  fully_shard for FSDP2: how each project's documentation applies it. DeepSpeed is eager only.

Each row is built alone in the same process, warmed up (the first step's seconds, compile included,
are kept), then 10 steps are timed with a synchronise around each. MFU is the model's FLOPs per
token (6 Psi + attention) x tokens/s over the H100 SXM datasheet's 989 TFLOP/s dense bf16, and
beside it over the bf16 matmul rate measured in the same run. Rows are appended to
OUTDIR/fastpath.jsonl as they finish, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from functools import partial

import torch

import zerolab as zl
from gpu.common import bench_cfg, bf16_matmul_peak, compute_device, machine, token_batch
from zerolab.bench import DEEPSPEED_GRADIENT_CLIPPING, deepspeed_config, fsdp2, make_zerolab, torch_ddp
from zerolab.book.mfu import flops_per_token
from zerolab.models import GPT, gpt_loss

H100_SXM_BF16_DENSE = 989e12      # NVIDIA H100 datasheet, SXM5, dense (the 1,979 figure is with sparsity)
EAGER = ("zl.DDP", "zl.ZeRO-1", "zl.ZeRO-2", "zl.ZeRO-3", "PyTorch DDP", "FSDP2 reshard=False",
         "FSDP2 reshard=True", "DeepSpeed ZeRO-1", "DeepSpeed ZeRO-2", "DeepSpeed ZeRO-3")
COMPILED = ("zl.DDP", "PyTorch DDP", "zl.ZeRO-2", "FSDP2 reshard=False", "zl.ZeRO-3", "FSDP2 reshard=True",
            "zl.ZeRO-1")
BUCKET_MB = 25.0


def fused_adamw(params):
    return torch.optim.AdamW(params, lr=3e-4, fused=True)


def build(name, model, compiled, batch, dev):
    """(forward, backward, step, zero_grad, autocast, what) for one row."""
    if name.startswith("zl."):
        eng = make_zerolab(name, torch.compile(model) if compiled else model, fused_adamw,
                           precision="bf16", bucket_mb=BUCKET_MB, track_peak=False, track_activations=False)
        return eng, eng.backward, eng.step, eng.zero_grad, False, "AdamW(fused=True)"
    if name.startswith("DeepSpeed"):
        import deepspeed
        cfg = deepspeed_config(int(name[-1]), batch, BUCKET_MB, bf16=True, overlap=True, adamw_lr=3e-4)
        eng, opt, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        inner = getattr(opt, "optimizer", opt)
        return eng, eng.backward, eng.step, (lambda: None), False, type(inner).__name__
    if name == "PyTorch DDP":
        m = torch_ddp(model, BUCKET_MB, dev)
        opt = fused_adamw(m.parameters())
        fwd = torch.compile(m) if compiled else m
        return fwd, (lambda loss: loss.backward()), opt.step, partial(opt.zero_grad, set_to_none=True), True, \
            "AdamW(fused=True), autocast bf16"
    model = fsdp2(model, reshard=name.endswith("True"), device_type=dev.type, bf16=True)
    try:
        opt, what = fused_adamw(model.parameters()), "AdamW(fused=True)"
    except Exception as e:  # noqa: BLE001 - a torch without fused DTensor AdamW: its default, said so
        opt, what = torch.optim.AdamW(model.parameters(), lr=3e-4), f"AdamW (fused refused: {type(e).__name__})"
    fwd = torch.compile(model) if compiled else model
    return fwd, (lambda loss: loss.backward()), opt.step, partial(opt.zero_grad, set_to_none=True), False, what


def fastpath_worker(cfg_name, batch, names, compiled, warmup, steps, jsonl):
    from gpu.common import settle
    dev = compute_device()
    cfg = bench_cfg(cfg_name)
    start = settle(dev)
    for name in names:
        row = {"engine": name + (" compiled" if compiled else ""), "compiled": compiled}
        torch._dynamo.reset()
        base = settle(dev)          # as gpu.workers.bench_worker: garbage collected first
        try:
            torch.manual_seed(0)
            model = GPT(cfg).to(dev)
            psi = sum(p.numel() for p in model.parameters())
            fwd, bwd, stp, zero, autocast, row["optimizer"] = build(name, model, compiled, batch, dev)
            del model

            def one(s):
                x, y = token_batch(cfg, s, batch, 0, 1, dev)
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                    _, loss = gpt_loss(fwd, (x, y))
                bwd(loss)
                stp()
                zero()
                return loss.item()       # a float: no tensor of this row outlives it
            first = []
            for s in range(warmup):
                t = time.perf_counter()
                one(s)
                torch.cuda.synchronize()
                first.append(time.perf_counter() - t)
            torch.cuda.reset_peak_memory_stats(dev)
            times = []
            for s in range(warmup, warmup + steps):
                torch.cuda.synchronize()
                t = time.perf_counter()
                loss = one(s)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
            row.update(ok=True, psi=psi, warmup_s=first, times=times, loss=loss,
                       peak_abs=torch.cuda.max_memory_allocated(dev))
            del fwd, bwd, stp, zero, one
        except Exception as e:  # noqa: BLE001 - a row that cannot run here is reported, not fatal
            row.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
                       where=traceback.format_exc()[-1500:])
        after = settle(dev)
        row.update(leftover_bytes=base - start, after_bytes=after - start)
        if row["ok"]:      # against the level with no engine alive (see gpu.workers.bench_worker)
            row["peak_bytes"] = row.pop("peak_abs") - min(base, after)
        with open(jsonl, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{row['engine']:32s} " + (f"median {statistics.median(row['times']) * 1e3:7.1f} ms, first steps "
              f"{', '.join(f'{t:.1f}' for t in row['warmup_s'])} s" if row["ok"] else f"FAILED {row['error']}"),
              flush=True)
    return None


def summarize(jsonl, cfg_name, batch, matmul_flops):
    cfg = bench_cfg(cfg_name)
    from gpu.bench import formula
    rows = []
    with open(jsonl) as f:
        for line in f:
            r = json.loads(line)
            if r["ok"]:
                ms = statistics.median(r["times"]) * 1e3
                tok = batch * cfg.block_size / (ms / 1e3)
                fpt = flops_per_token(cfg, r["psi"])
                f_ = formula(r["engine"].replace(" compiled", ""), r["psi"], 1)
                r.update(step_ms=ms, step_ms_min=min(r["times"]) * 1e3, step_ms_max=max(r["times"]) * 1e3,
                         tokens_per_s=tok, mfu_datasheet=fpt * tok / H100_SXM_BF16_DENSE,
                         matmul_utilisation=fpt * tok / matmul_flops if matmul_flops else None,
                         formula_model_state_bytes=f_, peak_over_formula=r["peak_bytes"] / f_)
            rows.append(r)
    return rows


def main(outdir, phase, quick=False, only=None):
    os.makedirs(outdir, exist_ok=True)
    cuda = torch.cuda.is_available()
    cfg_name, batch = ("350m", 8) if cuda and not quick else ("cpu-test", 2)
    if not cuda:
        print("no GPU: gpu.fastpath needs CUDA (fused AdamW, NCCL)")
        return
    names = [n for n in (EAGER if phase == "eager" else COMPILED) if not only or n.startswith(only)]
    tag = phase + (f"_{only.replace(' ', '_')}" if only else "")
    jsonl = os.path.join(outdir, f"fastpath_{tag}.jsonl")
    peak = bf16_matmul_peak()
    t = time.time()
    try:
        zl.launch(fastpath_worker, 1, timeout=560,
                  args=(cfg_name, batch, names, phase == "compiled", 3, 10, jsonl))
        error = None
    except Exception as e:  # noqa: BLE001 - the rows written so far are still worth keeping
        error = f"{type(e).__name__}: {str(e)[-800:]}"
        print("launch failed:", error, flush=True)
    rows = summarize(jsonl, cfg_name, batch, peak["flops"]) if os.path.exists(jsonl) else []
    out = {"machine": machine(), "what": f"{phase}: each side's fast path, world 1 (NCCL), bf16",
           "model": cfg_name, "batch": batch, "tokens_per_step": batch * bench_cfg(cfg_name).block_size,
           "datasheet_peak_flops": H100_SXM_BF16_DENSE, "matmul_peak": peak, "seconds": time.time() - t,
           "error": error, "rows": rows, "deepspeed_gradient_clipping": DEEPSPEED_GRADIENT_CLIPPING}
    with open(os.path.join(outdir, f"fastpath_{tag}.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    for r in rows:
        if r["ok"]:
            print(f"{r['engine']:32s} {r['step_ms']:7.1f} ms  {r['tokens_per_s']:9,.0f} tok/s  MFU "
                  f"{100 * r['mfu_datasheet']:.1f}%  peak {r['peak_bytes'] / 1e9:.2f} GB "
                  f"(formula {r['formula_model_state_bytes'] / 1e9:.2f})  {r['optimizer']}")


if __name__ == "__main__":
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None
    main(sys.argv[1], sys.argv[2], quick="--quick" in sys.argv, only=only)
