"""zerolab's engines beside PyTorch DDP, FSDP2 and DeepSpeed on the GPU, in bf16.

    python -m gpu.bench OUTDIR [--quick]

World 1 on NCCL (one GPU: NCCL needs one GPU per rank): a ~406 M-parameter GPT (GPT-2 medium
shape, untied head, vocab 50304, 1024 tokens) in bf16 with AdamW, 8 sequences a step. Each
engine is built alone, warmed up, then timed step by step (synchronised); memory is
torch.cuda.max_memory_allocated over the timed steps, beside the paper's formula for its
model states (gpu.workers.bench_worker says against which level). FLOPs per token (6 Psi +
attention, zerolab.book.mfu.flops_per_token: no FLOPs for the embedding lookups) x tokens/s over the H100 SXM datasheet's 989 TFLOP/s
dense bf16 is the MFU the book uses (mfu_datasheet); over the bf16 matmul rate measured in the
same run it is the matmul utilisation (matmul_utilisation), a larger number.

World 2 on gloo with CUDA tensors (two ranks sharing the one GPU): a ~163 M GPT (GPT-2 small
shape), two timed steps: per-rank memory only (gloo stages every collective through the host,
so its step times say nothing about a GPU interconnect).
"""

from __future__ import annotations

import csv
import os
import statistics
import sys

import torch

import zerolab as zl
from gpu.common import bench_cfg, bf16_matmul_peak, write_json
from gpu.workers.bench import BENCH_ENGINES, bench_worker
from zerolab.memory import model_state_bytes
from zerolab.book.mfu import flops_per_token
from zerolab.bench import DEEPSPEED_GRADIENT_CLIPPING
from zerolab.theory.cost_model import H100_PEAK_FLOPS

DEEPSPEED_NOTE = None


def formula(name, psi, n):
    """The paper's model-state bytes per rank for this engine's layout (bf16 params/grads, fp32
    master + Adam = K 12), or PyTorch's fp32 params + grads + Adam (autocast DDP, FSDP2)."""
    if name.startswith("zl.") or name.startswith("DeepSpeed"):
        stage = 0 if name == "zl.DDP" else int(name.split("-")[1][0])
        return model_state_bytes(psi, n, stage, k=12)
    if name == "PyTorch DDP":
        return model_state_bytes(psi, n, 0, k=8, param_bytes=4, grad_bytes=4)
    return model_state_bytes(psi, n, 3, k=8, param_bytes=4, grad_bytes=4)   # FSDP2: all sharded


def deepspeed_available():
    try:
        import deepspeed  # noqa: F401
        return True, f"DeepSpeed {deepspeed.__version__}"
    except Exception as e:  # noqa: BLE001
        return False, f"DeepSpeed not run: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def summarize(ranks, cfg_name, batch, n, peak_flops):
    cfg = bench_cfg(cfg_name)
    rows = []
    for name in ranks[0]["rows"]:
        rs = [r["rows"][name] for r in ranks]
        if not all(r["ok"] for r in rs):
            err = next(r for r in rs if not r["ok"])
            rows.append({"engine": name, "ran": False, "error": err["error"], "traceback": err.get("where")})
            continue
        psi = rs[0]["psi"]
        # a step lasts as long as its slowest rank
        steps = [max(r["times"][i] for r in rs) for i in range(len(rs[0]["times"]))]
        ms = statistics.median(steps) * 1e3
        tok_s = batch * cfg.block_size * n / (ms / 1e3)
        fpt = flops_per_token(cfg, psi)
        peak = max(r["peak"] for r in rs) if rs[0]["peak"] is not None else None
        f = formula(name, psi, n)
        worst = (lambda key: max(r[key] for r in rs) if rs[0].get(key) is not None else None)   # noqa: E731
        rows.append({"engine": name, "ran": True, "psi": psi, "step_ms": ms,
                     "step_ms_min": min(steps) * 1e3, "step_ms_max": max(steps) * 1e3, "times": steps,
                     "tokens_per_s": tok_s,
                     "mfu_datasheet": fpt * tok_s / H100_PEAK_FLOPS if n == 1 else None,
                     "matmul_utilisation": fpt * tok_s / peak_flops if peak_flops else None,
                     "held_bytes": worst("held"), "state_bytes": worst("state_bytes"),
                     "leftover_bytes": worst("leftover_bytes"), "after_bytes": worst("after_bytes"),
                     "peak_bytes": peak, "formula_model_state_bytes": f,
                     "peak_over_formula": peak / f if peak else None,
                     "reserved_peak_bytes": worst("reserved_peak"),
                     "final_loss": statistics.mean(r["loss"] for r in rs)})
    return rows


def table(rows, mfu=True):
    cols = ["engine", "step (ms)", "tokens/s"] + (["MFU"] if mfu else []) + \
        ["held (GB)", "peak (GB)", "formula (GB)", "peak / formula", "loss"]
    lines = ["| " + " | ".join(cols) + " |", "|---|" + "---:|" * (len(cols) - 1)]

    def gb(x):
        return "n/a" if x is None else f"{x / 1e9:.2f}"
    for r in rows:
        if not r["ran"]:
            lines.append(f"| {r['engine']} | not run: {r['error'][:90]} |" + " |" * (len(cols) - 2))
            continue
        f = [r["engine"], f"{r['step_ms']:.1f}", f"{r['tokens_per_s']:,.0f}"]
        if mfu:
            f.append("n/a" if r["mfu_datasheet"] is None else f"{100 * r['mfu_datasheet']:.1f}%")
        f += [gb(r["held_bytes"]), gb(r["peak_bytes"]), gb(r["formula_model_state_bytes"]),
              "n/a" if r["peak_over_formula"] is None else f"{r['peak_over_formula']:.2f}", f"{r['final_loss']:.4f}"]
        lines.append("| " + " | ".join(f) + " |")
    return "\n".join(lines)


def main(outdir, quick=False):
    os.makedirs(outdir, exist_ok=True)
    cuda = torch.cuda.is_available()
    peak = bf16_matmul_peak() if cuda else {"flops": None, "note": "no GPU"}
    ds_ok, ds_note = deepspeed_available()
    engines = tuple(e for e in BENCH_ENGINES if ds_ok or not e.startswith("DeepSpeed"))
    runs = [("world1", 1, None, "350m" if cuda else "cpu-test", 8 if cuda else 2, 3, 3 if quick else 10),
            ("world2", 2, "gloo", "124m" if cuda else "cpu-test", 4 if cuda else 2, 2, 2)]
    result = {"what": "bf16 training step of a GPT: zerolab engines beside PyTorch DDP, FSDP2, DeepSpeed",
              "matmul_peak": peak, "deepspeed": ds_note, "deepspeed_gradient_clipping": DEEPSPEED_GRADIENT_CLIPPING,
              "runs": {}}
    for key, n, backend, cfg_name, batch, warmup, steps in runs:
        cfg = bench_cfg(cfg_name)
        eng = engines if n == 1 else tuple(e for e in engines if not e.startswith("DeepSpeed")
                                           and e != "zl.ZeRO-3 prefetch=0")
        entry = {"world_size": n, "model": cfg_name, "config": cfg.__dict__, "batch_per_rank": batch,
                 "tokens_per_step": batch * cfg.block_size * n, "warmup": warmup, "timed_steps": steps,
                 "bucket_mb": 25.0}
        try:
            ranks = zl.launch(bench_worker, n, backend=backend, timeout=500,
                              args=(cfg_name, batch, 25.0, warmup, steps, eng))
            entry["backend"], entry["device"] = ranks[0]["backend"], ranks[0]["device"]
            entry["rows"] = summarize(ranks, cfg_name, batch, n, peak["flops"] if n == 1 else None)
            print(f"\n{key}: {entry['backend']} on {entry['device']}, {cfg_name}, batch {batch}/rank")
            print(table(entry["rows"], mfu=(n == 1)), flush=True)
        except Exception as e:  # noqa: BLE001
            entry["error"] = f"{type(e).__name__}: {str(e)[-1500:]}"
            print(f"{key}: FAILED {entry['error'][:600]}", flush=True)
        result["runs"][key] = entry
    write_json(os.path.join(outdir, "bench.json"), result)
    with open(os.path.join(outdir, "bench.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "engine", "ran", "step_ms", "tokens_per_s", "mfu_datasheet", "held_bytes", "peak_bytes",
                    "formula_model_state_bytes", "peak_over_formula", "final_loss", "error"])
        for key, entry in result["runs"].items():
            for r in entry.get("rows", []):
                w.writerow([key, r["engine"], r["ran"], r.get("step_ms"), r.get("tokens_per_s"), r.get("mfu_datasheet"),
                            r.get("held_bytes"), r.get("peak_bytes"), r.get("formula_model_state_bytes"),
                            r.get("peak_over_formula"), r.get("final_loss"), r.get("error", "")])
    return result


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gpu_out", quick="--quick" in sys.argv)
