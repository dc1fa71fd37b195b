"""ZeRO-Offload and ZeRO-Infinity on CUDA: offload="optimizer" at stages 1-3 and offload="disk" at
stage 3, against the same engine without offload and beside DeepSpeed's offload_optimizer.

    python -m gpu.offload_cuda OUTDIR [--second]     # --second: the rows of the second run only

World 1 on NCCL, the ~163 M GPT of gpu.bench (GPT-2 small shape, untied head) in bf16, 8 sequences
of 1,024 tokens a step, torch's AdamW (zerolab runs it on the host for the offloaded shard, on the
GPU without offload). Per row: the median step of 3 after 2 warm-up steps; the device <-> host
bytes and seconds per step from the engine's ledger (engine.transfers) beside the closed form
(d2h = Psi_pad x 2 bytes of the bf16 gradient, h2d = Psi_pad x 2; at N = 1, Psi_pad = Psi) and
beside bytes / the pinned copy rate measured first; the disk's bytes per step from /proc/self/io;
peak GPU memory; and after the 5 steps the largest difference of any weight from the same stage
without offload (the CPU suite proves them equal bit for bit on the CPU, where both updates run
the same kernels; here one runs on the GPU and one on the host).

DeepSpeed rows use its documented configuration ("offload_optimizer": cpu, pinned; "optimizer":
AdamW, which DeepSpeed runs as its compiled DeepSpeedCPUAdam op, built here with ninja; the row says
if it could not be built).
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from functools import partial

import torch

import zerolab as zl
from gpu.common import bench_cfg, compute_device, machine, token_batch
from gpu.workers.offload import pcie_bandwidth
from zerolab.bench import DEEPSPEED_GRADIENT_CLIPPING, deepspeed_config
from zerolab.models import GPT, gpt_loss

ROWS = (("zl.ZeRO-1", 1, None), ("zl.ZeRO-1", 1, "optimizer"),
        ("zl.ZeRO-2", 2, None), ("zl.ZeRO-2", 2, "optimizer"), ("zl.ZeRO-2", 2, "optimizer fused"),
        ("zl.ZeRO-3", 3, None), ("zl.ZeRO-3", 3, "optimizer"), ("zl.ZeRO-3", 3, "optimizer fused"),
        ("zl.ZeRO-3", 3, "disk fused"),
        ("DeepSpeed ZeRO-2", 2, "optimizer"), ("DeepSpeed ZeRO-3", 3, "optimizer"),
        ("DeepSpeed ZeRO-1", 1, "optimizer"))
# the second, shorter run (after the host cast and the disk engine's GPU path were fixed)
SECOND = ("zl.ZeRO-2 None", "zl.ZeRO-2 optimizer", "zl.ZeRO-2 optimizer fused", "zl.ZeRO-3 None",
          "zl.ZeRO-3 optimizer fused", "zl.ZeRO-3 disk fused", "DeepSpeed ZeRO-2 optimizer",
          "DeepSpeed ZeRO-3 optimizer")
ADAMW = partial(torch.optim.AdamW, lr=3e-4)
FUSED_ADAMW = partial(torch.optim.AdamW, lr=3e-4, fused=True)   # one vectorised pass on the host


def disk_io():
    with open("/proc/self/io") as f:
        kv = dict(line.split(": ") for line in f.read().splitlines())
    return int(kv["read_bytes"]), int(kv["write_bytes"])


def deepspeed_engine(stage, model, batch):
    import deepspeed
    cfg = deepspeed_config(stage, batch, None, bf16=True, overlap=True, adamw_lr=3e-4, offload_optimizer=True)
    eng, opt, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return eng, type(getattr(opt, "optimizer", opt)).__name__


def offload_cuda_worker(cfg_name, batch, warmup, steps, jsonl, only=None):
    dev = compute_device()
    cfg = bench_cfg(cfg_name)
    finals = {}
    for name, stage, how in ROWS:
        if only and f"{name} {how}" not in only:
            continue
        offload, fused = (how.split()[0], how.endswith("fused")) if how else (None, False)
        row = {"engine": name, "stage": stage, "offload": offload, "host_adam_fused": fused}
        gc.collect()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(dev)
        tmp = tempfile.mkdtemp(prefix="zl-disk-", dir="/tmp") if offload == "disk" else None
        try:
            torch.manual_seed(0)
            model = GPT(cfg).to(dev)
            psi = sum(p.numel() for p in model.parameters())
            if name.startswith("DeepSpeed"):
                eng, row["optimizer"] = deepspeed_engine(stage, model, batch)
                zero = (lambda: None)
            else:
                kw = {} if offload is None else {"offload": offload}
                if offload == "disk":
                    kw["offload_dir"] = tmp
                eng = zl.ZeRO(model, FUSED_ADAMW if fused else ADAMW, stage=stage, precision="bf16", track_peak=False,
                              track_activations=False, **kw)
                zero, row["optimizer"] = eng.zero_grad, ("torch AdamW(fused=True)" if fused else "torch AdamW") + \
                    (" on the host" if offload else " on the GPU")
            del model
            ledger = getattr(eng, "transfers", None)
            times, moved, disk = [], [], []
            for s in range(warmup + steps):
                if ledger is not None:
                    ledger.reset()
                io0 = disk_io()
                torch.cuda.synchronize()
                t = time.perf_counter()
                _, loss = gpt_loss(eng, token_batch(cfg, s, batch, 0, 1, dev))
                eng.backward(loss)
                eng.step()
                zero()
                torch.cuda.synchronize()
                if s == warmup - 1:
                    torch.cuda.reset_peak_memory_stats(dev)
                if s >= warmup:
                    times.append(time.perf_counter() - t)
                    io1 = disk_io()
                    disk.append((io1[0] - io0[0], io1[1] - io0[1]))
                    if ledger is not None:
                        moved.append({d: (ledger.bytes(d), ledger.seconds(d)) for d in ("d2h", "h2d")})
            row.update(ok=True, psi=psi, times=times, step_ms=statistics.median(times) * 1e3, loss=loss.item(),
                       peak_bytes=torch.cuda.max_memory_allocated(dev) - base, transfers=moved, disk_io=disk)
            if name.startswith("zl."):
                final = torch.cat([v.flatten() for v in eng.full_state_dict().values() if v.is_floating_point()])
                if offload is None:
                    finals[stage] = final
                elif stage in finals:
                    d = (final - finals[stage]).abs()
                    row.update(bitwise_equal_to_no_offload=bool(torch.equal(final, finals[stage])),
                               max_abs_diff=d.max().item(), mean_abs_diff=d.mean().item(),
                               weights_max_abs=finals[stage].abs().max().item())
            del eng
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            row.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
                       where=traceback.format_exc()[-1500:])
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        with open(jsonl, "a") as f:
            f.write(json.dumps(row) + "\n")
        if row["ok"]:
            extra = ""
            if row["transfers"]:
                d2h, h2d = row["transfers"][-1]["d2h"], row["transfers"][-1]["h2d"]
                extra = f"d2h {d2h[0] / 1e6:.1f} MB in {d2h[1] * 1e3:.1f} ms, h2d {h2d[0] / 1e6:.1f} MB in {h2d[1] * 1e3:.1f} ms"
            if "max_abs_diff" in row:
                extra += f"  max |w - w_no_offload| {row['max_abs_diff']:.2e} (equal: {row['bitwise_equal_to_no_offload']})"
            print(f"{name} offload={offload}{' fused' if fused else ''}: {row['step_ms']:.1f} ms, peak {row['peak_bytes'] / 1e9:.2f} GB  {extra}",
                  flush=True)
        else:
            print(f"{name} offload={offload}: FAILED {row['error']}", flush=True)
    return None


def main(outdir, second=False):
    os.makedirs(outdir, exist_ok=True)
    if not torch.cuda.is_available():
        print("no GPU: gpu.offload_cuda measures PCIe copies and needs CUDA")
        return
    jsonl = os.path.join(outdir, "offload_cuda.jsonl")
    pcie = pcie_bandwidth()
    print(f"pinned copies: host->device {pcie['host_to_device'] / 1e9:.1f} GB/s, "
          f"device->host {pcie['device_to_host'] / 1e9:.1f} GB/s", flush=True)
    error = None
    try:
        zl.launch(offload_cuda_worker, 1, timeout=560, args=("124m", 8, 2, 3, jsonl, SECOND if second else None))
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {str(e)[-800:]}"
        print("launch failed:", error, flush=True)
    rows = []
    if os.path.exists(jsonl):
        with open(jsonl) as f:
            rows = [json.loads(line) for line in f]
    for r in rows:          # the closed forms, from the parameter count alone
        if r.get("ok") and r["offload"] and r["engine"].startswith("zl."):
            r["closed_form_bytes"] = {"d2h": 2 * r["psi"], "h2d": 2 * r["psi"]}
            r["closed_form_seconds_at_pinned_rate"] = {"d2h": 2 * r["psi"] / pcie["device_to_host"],
                                                       "h2d": 2 * r["psi"] / pcie["host_to_device"]}
    out = {"machine": machine(), "what": "offload on CUDA, world 1 (NCCL), bf16, GPT 124m shape",
           "pcie": pcie, "error": error, "rows": rows, "deepspeed_gradient_clipping": DEEPSPEED_GRADIENT_CLIPPING}
    with open(os.path.join(outdir, "offload_cuda.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main(sys.argv[1], second="--second" in sys.argv)
