"""Figures for the benchmark (chapter 10), drawn from the summary `zerolab.bench.run` returns."""

from __future__ import annotations

import os

import matplotlib
import matplotlib.pyplot as plt

FAMILY_COLORS = {"floor": "#8c8c8c", "zerolab": "#4C72B0", "PyTorch": "#DD8452", "DeepSpeed": "#55A868"}
OTHER_SETTING = "#8172B3"   # a zerolab engine with another setting: prefetch=0, bitwise=True


def bench_figure(s):
    """Three panels, one bar per engine: step time vs the floor (the whisker spans the lowest
    to the highest round's median), peak memory, bytes per step."""
    rows = s["rows"]
    names = [r["engine"] for r in rows]
    colors = [FAMILY_COLORS.get(r["family"], OTHER_SETTING) for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2), sharey=True)
    y = list(range(len(rows)))
    panels = [("step time / floor (whisker: spread over rounds)", [r["vs_floor"] for r in rows]),
              ("peak memory per rank (MB)", [r["peak"] / 1e6 for r in rows]),
              ("bytes sent per step and rank (MB)", [(r["bytes"] or 0) / 1e6 for r in rows])]
    for ax, (title, vals) in zip(axes, panels):
        ax.barh(y, vals, color=colors)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    lo = [r["vs_floor"] - r["vs_floor_spread"][0] for r in rows]
    hi = [r["vs_floor_spread"][1] - r["vs_floor"] for r in rows]
    axes[0].errorbar([r["vs_floor"] for r in rows], y, xerr=[lo, hi], fmt="none", ecolor="black",
                     elinewidth=1, capsize=3)
    axes[0].axvline(1.0, color="black", lw=0.8)
    axes[0].set_yticks(y, names)
    axes[0].invert_yaxis()
    handles = [matplotlib.patches.Patch(color=c, label=f) for f, c in FAMILY_COLORS.items()]
    if any(r["family"] not in FAMILY_COLORS for r in rows):
        handles.append(matplotlib.patches.Patch(color=OTHER_SETTING, label="zerolab, another setting"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False)
    fig.suptitle(f"GPT {s['size']!r}, {s['world_size']} ranks, batch {s['batch']} per rank, "
                 f"{s.get('reps', 1)} rounds (this machine)")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


def plot_bench(s, out_dir) -> list[str]:
    """Write the benchmark figure into out_dir; returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "bench.png")
    fig = bench_figure(s)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


STAGE_COLORS = {0: "#8c8c8c", 1: "#4C72B0", 2: "#DD8452", 3: "#55A868"}
STAGE_NAMES = {0: "DP (stage 0)", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}


def calculator_figure(psi, device_gb, n_ds=(1, 4, 16, 64, 256, 1024), activations_gb=0.0, n_m=1):
    """Per-device GB against N_d for each stage, the device's capacity as a line."""
    from ..theory.calculator import plan
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for stage in (0, 1, 2, 3):
        ys = [plan(psi, device_gb, n, n_m, activations_gb=activations_gb)[stage]["total_gb"] for n in n_ds]
        ax.plot(n_ds, ys, marker="o", color=STAGE_COLORS[stage], label=STAGE_NAMES[stage])
    ax.axhline(device_gb, color="black", ls="--", lw=1, label=f"device: {device_gb:g} GB")
    if activations_gb:
        ax.axhline(activations_gb, color="#C44E52", ls=":", lw=1.2, label=f"activations alone: {activations_gb:.3g} GB")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("$N_d$ (data-parallel ranks)")
    ax.set_ylabel("GB per device")
    ax.set_title(f"{psi / 1e9:g}B parameters, $N_m$ = {n_m}", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def scaling_figure(results, psi, formula, comm_formula):
    """Two panels, measured (dots) against the formula (lines) at each N: model-state bytes per
    rank, and the bytes per rank the ledger booked for one step."""
    ns = sorted(results)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for s in (0, 1, 2, 3):
        c = STAGE_COLORS[s]
        a.plot(ns, [formula(psi, n, s) / 2**20 for n in ns], color=c, lw=1.2, label=f"{STAGE_NAMES[s]} formula")
        a.plot(ns, [results[n][s]["states"] / 2**20 for n in ns], "o", color=c, ms=7, label=f"{STAGE_NAMES[s]} measured")
        # DDP, ZeRO-1 and ZeRO-2 book the same bytes: offset their dots a little to see all three
        dx = {0: -0.06, 1: 0.0, 2: 0.06, 3: 0.0}[s]
        b.plot(ns, [comm_formula(psi, n, s) / 2**20 for n in ns], color=c, lw=1.2)
        b.plot([n + dx for n in ns], [results[n][s]["comm"] / 2**20 for n in ns], "o", color=c, ms=7,
               label=STAGE_NAMES[s])
    a.set_ylabel("model states per rank (MiB)")
    b.set_ylabel("bytes sent per rank and step (MiB)")
    a.set_title("memory: 16Ψ, split one more term per stage", fontsize=9)
    b.set_title("communication: ring model, 2(N-1)/N · 4Ψ (ZeRO-3: 3(N-1)/N · 4Ψ)", fontsize=9)
    for ax in (a, b):
        ax.set_xlabel("N (ranks)")
        ax.set_xticks(ns)
        ax.grid(alpha=0.3)
    a.legend(fontsize=7, ncol=2)
    b.legend(fontsize=8)
    fig.tight_layout()
    return fig


def choice_figure(rows, device_gb, title):
    """One panel per tokens-per-GPU setting: each stage placed by its model-state GB per GPU
    (the calculator) and its step time (the cost model); the device's memory as a line."""
    tokens = sorted({r["tokens"] for r in rows})
    fig, axes = plt.subplots(1, len(tokens), figsize=(5.2 * len(tokens), 4), sharey=False)
    for ax, t in zip(axes, tokens):
        for r in (r for r in rows if r["tokens"] == t):
            ax.scatter([r["gb"]], [r["step_ms"]], s=110, color=STAGE_COLORS[r["stage"]], zorder=3,
                       marker="o" if r["fits"] else "x")
            ax.annotate(STAGE_NAMES[r["stage"]], (r["gb"], r["step_ms"]), textcoords="offset points",
                        xytext={2: (-42, 8)}.get(r["stage"], (6, 8)), fontsize=9)
        here = [r for r in rows if r["tokens"] == t]
        top = 1.2 * max(r["step_ms"] for r in here)
        ax.set_ylim(0, top)
        ax.axhline(here[0]["compute_ms"], color="#8c8c8c", ls=":", lw=1.2)
        ax.text(1.05, here[0]["compute_ms"], "compute alone", fontsize=8, va="top", color="#555555")
        ax.axvline(device_gb, color="black", ls="--", lw=1)
        ax.text(device_gb, 0.97 * top, f" {device_gb:g} GB per GPU", fontsize=8, va="top")
        ax.set_xscale("log")
        ax.set_xlim(1, 300)
        ax.set_xlabel("model states per GPU (GB, calculator)")
        ax.set_ylabel("step time (ms, cost model)")
        ax.set_title(f"{t:,} tokens per GPU per step", fontsize=9)
        ax.grid(alpha=0.3, which="both")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------ GPU results (gpu/results/, no GPU needed)


def _engine_label(name: str, clipped: bool) -> str:
    from .gpu_results import precision
    return f"{name}{' (clip 1.0)' if clipped else ''}\n{precision(name)}"


def gpu_bench_figure(reps):
    """Chapter 10's GPU bench, from the committed repetitions (gpu/results/bench.json, bench_rep2.json): MFU per
    engine and repetition at world 1 (the book's count: no embedding lookups), memory at world 1 against the
    formula, and per-rank memory at world 2. DeepSpeed's rows that ran with its default clipping are hatched."""
    from . import gpu_results as gr
    m = reps[0]["machine"]
    w1 = [[r for r in rep["runs"]["world1"]["rows"] if r["ran"]] for rep in reps]
    names = [r["engine"] for r in w1[0]]
    clip = {n: any(gr.clipped(n, rep) for rep in reps) for n in names}
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 5.2))
    width = 0.8 / len(reps)
    for i, rows in enumerate(w1):
        by = {r["engine"]: r for r in rows}
        a.barh([j + i * width for j in range(len(names))], [100 * gr.mfu(by[n], reps[i]) for n in names], height=width,
               color=["#4C72B0", "#DD8452"][i], hatch=["//" if clip[n] else "" for n in names],
               label=f"repetition {i + 1} (machine start {i + 1})")
    a.set_yticks([j + width * (len(reps) - 1) / 2 for j in range(len(names))],
                 [_engine_label(n, clip[n]) for n in names], fontsize=6.5)
    a.invert_yaxis()
    a.set_xlabel("MFU (%): model FLOPs/s over the datasheet's 989 TFLOP/s", fontsize=8)
    a.set_title(f"speed, world 1 (NCCL), {w1[0][0]['psi'] / 1e6:.0f} M GPT\n(hatched: DeepSpeed clipping to 1.0)",
                fontsize=9)
    a.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=1)
    rows = w1[0]
    mem = gr.world1_memory(reps[0])      # measured, or re-derived where the level moved (hatched)
    hatch = ["//" if mem[r["engine"]][2] else "" for r in rows]
    b.barh(range(len(rows)), [mem[r["engine"]][1] / 1e9 for r in rows], color="tab:blue", hatch=hatch,
           label="peak allocated")
    b.barh(range(len(rows)), [mem[r["engine"]][0] / 1e9 for r in rows], color="tab:green", hatch=hatch,
           label="held (hatched: re-derived)")
    b.scatter([r["formula_model_state_bytes"] / 1e9 for r in rows], range(len(rows)), color="k", marker="|", s=200,
              label="formula (model states)", zorder=3)
    b.set_yticks(range(len(rows)), [r["engine"] for r in rows], fontsize=7)
    b.invert_yaxis()
    b.set_xlabel("GB on the GPU", fontsize=8)
    b.set_title("memory, world 1, repetition 1", fontsize=9)
    b.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=1)
    w2 = [r for r in reps[0]["runs"]["world2"]["rows"] if r["ran"]]
    c.barh(range(len(w2)), [r["peak_bytes"] / 1e9 for r in w2], color="tab:blue", label="peak allocated / rank")
    c.barh(range(len(w2)), [r["held_bytes"] / 1e9 for r in w2], color="tab:green", label="held / rank")
    c.scatter([r["formula_model_state_bytes"] / 1e9 for r in w2], range(len(w2)), color="k", marker="|", s=200,
              label="formula / rank", zorder=3)
    c.set_yticks(range(len(w2)), [r["engine"] for r in w2], fontsize=7)
    c.invert_yaxis()
    c.set_xlabel("GB per rank", fontsize=8)
    c.set_title(f"memory per rank, world 2 (gloo), {w2[0]['psi'] / 1e6:.0f} M GPT", fontsize=9)
    c.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=1)
    for ax in (a, b, c):
        ax.tick_params(axis="x", labelsize=7)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"Measured on a GPU: {m['device']}, {m['date']}, torch {m['torch']}, CUDA {m['cuda']}", fontsize=10)
    fig.tight_layout()
    return fig


def fastpath_figure(runs, machine):
    """Chapter 11's H200 start (zerolab.book.gpu_results_ch11_13.h200_runs): each engine's median step, eager and
    compiled, one marker per repetition; DeepSpeed's rows (clipping to 1.0) are labelled so."""
    from . import gpu_results as gr
    names = list(runs["eager", 1])
    fig, ax = plt.subplots(figsize=(9, 4.8))
    styles = {("eager", 1): ("o", "#4C72B0"), ("eager", 2): ("o", "#A1C9F4"),
              ("compiled", 1): ("^", "#DD8452"), ("compiled", 2): ("^", "#FFB482")}
    for (mode, rep), (marker, color) in styles.items():
        pts = [(runs[mode, rep][n]["step_ms"], j) for j, n in enumerate(names) if n in runs[mode, rep]]
        ax.scatter([p[0] for p in pts], [p[1] + (0.15 if mode == "compiled" else -0.15) for p in pts], marker=marker,
                   s=55, color=color, edgecolor="black", linewidth=0.5, label=f"{mode}, repetition {rep}", zorder=3)
    ax.set_yticks(range(len(names)), [f"{n}{' (clip 1.0)' if gr.clipped(n, {}) else ''}" for n in names], fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ticks = [t for t in (50, 60, 80, 100, 150, 200, 300, 400) if t <= 1.1 * max(
        r["step_ms"] for rows in runs.values() for r in rows.values())]
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("median step time (ms, log scale): less is faster", fontsize=9)
    ax.set_title(f"Each side's fast path, world 1, chapter 10's GPT: {machine['device']}, one machine start "
                 f"({machine['date']})", fontsize=10)
    ax.grid(axis="x", alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    return fig


def activation_figure(rows, device_gb):
    """Stacked bars of GB per device: model states and activations for each (label, states_gb, activations_gb),
    with the device's memory as a line (chapter 10: the paper's activation estimate, zerolab.theory.calculator)."""
    fig, ax = plt.subplots(figsize=(8, 3.4))
    y = list(range(len(rows)))
    states = [r[1] for r in rows]
    acts = [r[2] for r in rows]
    ax.barh(y, states, color="#4C72B0", label="model states")
    ax.barh(y, acts, left=states, color="#C44E52", label="activations")
    for j, (s, a) in enumerate(zip(states, acts)):
        ax.text(s + a, j, f" {s + a:.1f} GB", va="center", fontsize=8)
    ax.axvline(device_gb, color="black", ls="--", lw=1)
    ax.text(device_gb, len(rows) - 0.6, f" {device_gb:g} GB device", fontsize=8, va="center")
    ax.set_yticks(y, [r[0] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.25 * max(max(s + a for s, a in zip(states, acts)), device_gb))
    ax.set_xlabel("GB per device (calculator: model states + the paper's activation estimate)")
    ax.set_title("Activations, not model states, decide whether it fits", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


ROOF_COLORS = {"matmul": "#4C72B0", "attention": "#8172B3", "memory": "#C44E52", "optimizer": "#DD8452"}


def roofline_figure(steps):
    """One stacked bar per step (label, zerolab.theory.roofline.step_time's dict, MFU bound): each kind of
    operation's share of the step's time at its roofs, with the step's ms and the bound written beside it."""
    from ..theory.roofline import KINDS
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.9 * len(steps)))
    for j, (label, t, bound) in enumerate(steps):
        left = 0.0
        for kind in KINDS:
            share = 100 * t[kind] / t["total"]
            ax.barh(j, share, left=left, color=ROOF_COLORS[kind], label=kind if j == 0 else None)
            if share > 6:
                ax.text(left + share / 2, j, f"{share:.0f}%", ha="center", va="center", fontsize=8, color="white")
            left += share
        ax.text(101, j, f"{1e3 * t['total']:.0f} ms at the roofs\nMFU at most {100 * bound:.0f}%", va="center",
                fontsize=8)
    ax.set_yticks(range(len(steps)), [s[0] for s in steps], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 130)
    ax.set_xticks(range(0, 101, 20))
    ax.set_xlabel("share of the step's time at the roofs (%)")
    ax.set_title("Where a step's time goes on an H100's roofline (red: memory-bound)", fontsize=10)
    ax.legend(fontsize=8, ncol=4, loc="upper center", bbox_to_anchor=(0.4, -0.35 if len(steps) < 3 else -0.2),
              frameon=False)
    fig.tight_layout()
    return fig
