"""torch.profiler traces of zl.DDP, zl.ZeRO-3 (with and without prefetch) and PyTorch DDP, summarised.

    python -m gpu.profile_steps OUTDIR

World 1 on NCCL: with one rank a collective moves nothing between GPUs, so the trace cannot
show communication hidden behind compute; it shows where the collectives are issued (their
kernels, on which stream, while which compute runs) and what the engine's own work costs
around them (copies, casts, the gaps where the GPU waits for Python).
"""

from __future__ import annotations

import os
import sys

import torch

import zerolab as zl
from gpu.common import write_json
from gpu.workers.profile_steps import profile_worker


def _union(iv):
    out = []
    for s, e in sorted(iv):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def _length(iv):
    return sum(e - s for s, e in iv)


def _intersect(a, b):
    i = j = 0
    tot = 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            tot += e - s
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tot


def is_comm(name):
    n = name.lower()
    return "nccl" in n


def summarize(eng):
    ks = eng["kernels"]
    if not ks:
        return {"kernels": 0}
    start = eng["step_cpu_range"][0][0] if eng["step_cpu_range"] else min(k[2] for k in ks)
    step = [k for k in ks if k[2] >= start]    # the last profiled step
    comm = [(k[2], k[2] + k[3]) for k in step if is_comm(k[0])]
    comp = [(k[2], k[2] + k[3]) for k in step if not is_comm(k[0])]
    t0 = min(k[2] for k in step)
    t1 = max(k[2] + k[3] for k in step)
    cu, mu = _union(comp), _union(comm)
    names = {}
    for k in step:
        if is_comm(k[0]):
            short = k[0].split("(")[0][:60]
            names[short] = names.get(short, 0) + 1
    streams = sorted({k[1] for k in step})
    return {"gpu_span_us": t1 - t0, "kernels": len(step), "compute_busy_us": _length(cu),
            "comm_kernels": len(comm), "comm_busy_us": _length(mu), "comm_overlapped_us": _intersect(cu, mu),
            "gpu_idle_us": (t1 - t0) - _length(_union(comp + comm)),
            "comm_kernel_names": names, "streams": streams,
            "comm_streams": sorted({k[1] for k in step if is_comm(k[0])}),
            "timeline": [(k[1], round(k[2] - t0, 1), round(k[3], 1), int(is_comm(k[0]))) for k in step
                         if k[3] >= 20 or is_comm(k[0])][:4000]}


def plot(summary, path, machine):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [n for n in summary if summary[n].get("kernels")]
    fig, axes = plt.subplots(len(names), 1, figsize=(8, 1.0 + 1.0 * len(names)), dpi=100, squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        s = summary[name]
        streams = s["streams"]
        for stream, t, d, comm in s["timeline"]:
            ax.barh(streams.index(stream), d / 1e3, left=t / 1e3, height=0.8,
                    color="tab:orange" if comm else "tab:blue", linewidth=0)
        ax.set_yticks(range(len(streams)), [f"stream {x}" for x in streams], fontsize=7)
        ax.set_title(f"{name}: GPU span {s['gpu_span_us'] / 1e3:.1f} ms, idle {s['gpu_idle_us'] / 1e3:.1f} ms, "
                     f"{s['comm_kernels']} NCCL kernels (orange)", fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
    axes[-1, 0].set_xlabel("ms into the step (kernels >= 20 us, and every NCCL kernel)", fontsize=8)
    fig.suptitle(f"One bf16 step, world 1 on NCCL ({machine['device']}, {machine['date']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(outdir):
    os.makedirs(outdir, exist_ok=True)
    cuda = torch.cuda.is_available()
    trace_dir = "/tmp/zerolab_traces"   # the full chrome traces stay on the machine (large)
    os.makedirs(trace_dir, exist_ok=True)
    r = zl.launch(profile_worker, 1, timeout=500, args=("350m" if cuda else "cpu-test", 8 if cuda else 2, trace_dir))[0]
    summary = {name: summarize(e) for name, e in r["engines"].items()}
    for name, s in summary.items():
        if s.get("kernels"):
            print(f"{name:24s} span {s['gpu_span_us'] / 1e3:7.1f} ms, compute {s['compute_busy_us'] / 1e3:7.1f} ms, "
                  f"idle {s['gpu_idle_us'] / 1e3:6.1f} ms, {s['comm_kernels']:3d} NCCL kernels "
                  f"({s['comm_busy_us'] / 1e3:.2f} ms, {s['comm_overlapped_us'] / 1e3:.2f} ms under compute) "
                  f"streams {s['streams']} comm on {s['comm_streams']}", flush=True)
    from gpu.common import machine
    result = {"what": "torch.profiler, one bf16 step per engine, world 1 on NCCL (kernels summarised)",
              "backend": r["backend"], "device": r["device"], "model": "gpu.workers.bench_cfg('350m'), batch 8",
              "note": __doc__.split("\n\n")[1].replace("\n", " "), "engines": summary}
    write_json(os.path.join(outdir, "profile.json"), result)
    if cuda:
        plot(summary, os.path.join(outdir, "profile.png"), machine())
    return result


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gpu_out")
