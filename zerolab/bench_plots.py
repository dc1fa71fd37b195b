"""Figures for the benchmark (chapter 10), drawn from the summary `zerolab.bench.run` returns."""

from __future__ import annotations

import os

import matplotlib
import matplotlib.pyplot as plt

FAMILY_COLORS = {"floor": "#8c8c8c", "zerolab": "#4C72B0", "PyTorch": "#DD8452", "DeepSpeed": "#55A868"}


def bench_figure(s):
    """Three panels, one bar per engine: step time vs the floor, peak memory, bytes per step."""
    rows = s["rows"]
    names = [r["engine"] for r in rows]
    colors = [FAMILY_COLORS.get(r["family"], "#8172B3") for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2), sharey=True)
    y = range(len(rows))
    panels = [("step time / floor", [r["vs_floor"] for r in rows]),
              ("peak memory per rank (MB)", [r["peak"] / 1e6 for r in rows]),
              ("bytes sent per step and rank (MB)", [(r["bytes"] or 0) / 1e6 for r in rows])]
    for ax, (title, vals) in zip(axes, panels):
        ax.barh(list(y), vals, color=colors)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    axes[0].axvline(1.0, color="black", lw=0.8)
    axes[0].set_yticks(list(y), names)
    axes[0].invert_yaxis()
    handles = [matplotlib.patches.Patch(color=c, label=f) for f, c in FAMILY_COLORS.items()]
    fig.legend(handles=handles, loc="lower center", ncol=4, frameon=False)
    fig.suptitle(f"GPT {s['size']!r}, {s['world_size']} ranks, batch {s['batch']} per rank (this machine)")
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
