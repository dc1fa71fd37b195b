"""Figures for chapters 6 and 7 (ZeRO-1 and ZeRO-2), drawn from layouts and measurements."""

from __future__ import annotations

import matplotlib.pyplot as plt
import torch
from matplotlib.patches import Rectangle

from ..theory import calculator
from ..buckets import FlatBuckets, bucket_order
from ..models import GPT, gpt_config

RANK_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]


def ownership(n: int = 4, size: str = "nano", bucket_mb: float = 0.02, max_buckets: int = 6):
    """Who owns what: zerolab's real bucket layout for the GPT, each bucket split into N slices.

    Thin black lines are parameter boundaries; the grey tail of a bucket is its padding.
    """
    torch.manual_seed(0)
    model = GPT(gpt_config(size, bias=False))
    fb = FlatBuckets(bucket_order(model), bucket_mb * 2**20, n)
    names = {id(p): name for name, p in model.named_parameters()}
    buckets = fb.buckets[:max_buckets]
    longest = max(b.padded_numel for b in buckets)
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(buckets) + 1.2))
    for row, b in enumerate(buckets):
        y = len(buckets) - 1 - row
        for r in range(n):
            s = b.shard(r)
            ax.add_patch(Rectangle((s.start, y), s.stop - s.start, 0.8, color=RANK_COLORS[r % 8], alpha=0.85))
        ax.add_patch(Rectangle((b.numel, y), b.padded_numel - b.numel, 0.8, color="#BBBBBB", hatch="///"))
        for o in b.offsets[1:]:
            ax.plot([o, o], [y, y + 0.8], color="black", lw=0.6)
        first = names[id(b.params[0])]
        ax.text(-0.01 * longest, y + 0.4, f"bucket {b.index}\n({len(b.params)} params, from {first})",
                ha="right", va="center", fontsize=7)
    for r in range(n):
        ax.add_patch(Rectangle((0, 0), 0, 0, color=RANK_COLORS[r % 8], label=f"rank {r} owns"))
    ax.add_patch(Rectangle((0, 0), 0, 0, color="#BBBBBB", hatch="///", label="padding"))
    ax.set_xlim(0, longest * 1.02)
    ax.set_ylim(-0.2, len(buckets))
    ax.set_yticks([])
    ax.set_xlabel("element of the flat bucket buffer")
    ax.set_title(f"GPT-{size}, N = {n}: rank r keeps master weights and optimizer state of slice r only",
                 fontsize=9)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    return fig


def memory_vs_nd(measured: dict, psi: int, formulas: dict, title: str = "", n_max: int = 8):
    """Measured bytes per parameter (markers) against each formula's curve over N_d.

    measured: {label: {n: bytes}}; formulas: {label: function n -> bytes}.
    """
    fig, ax = plt.subplots(figsize=(7, 4))
    ns = list(range(1, n_max + 1))
    for i, (label, points) in enumerate(measured.items()):
        color = RANK_COLORS[i % 8]
        ax.plot(ns, [formulas[label](n) / psi for n in ns], color=color, lw=1.2, ls="--",
                label=f"{label}: formula")
        xs = sorted(points)
        ax.plot(xs, [points[x] / psi for x in xs], "o", color=color, ms=7, label=f"{label}: measured")
    ax.set_xlabel("$N_d$ (data-parallel ranks)")
    ax.set_ylabel("model-state bytes per parameter, per rank")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    return fig


def bytes_bars(rows: dict, unit: float, unit_name: str, title: str = ""):
    """Stacked bars of bytes sent per step by collective: rows = {engine: {op: bytes}}."""
    colors = {"all_reduce": "#C44E52", "reduce_scatter": "#4C72B0", "all_gather": "#55A868"}
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for x, (label, ops) in enumerate(rows.items()):
        bottom = 0.0
        for op, color in colors.items():
            h = ops.get(op, 0) / unit
            if h:
                ax.bar(x, h, bottom=bottom, color=color, width=0.55, edgecolor="white",
                       label=op if op not in ax.get_legend_handles_labels()[1] else None)
                ax.text(x, bottom + h / 2, f"{h:.2f}", ha="center", va="center", color="white", fontsize=8)
                bottom += h
    ax.set_xticks(range(len(rows)), list(rows))
    ax.set_ylabel(unit_name)
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    return fig


def grad_timeline(traces: dict, psi: int, n: int, elem: int = 4, title: str = ""):
    """Gradient bytes held at each gradient hook of one backward: traces = {label: [bytes]}."""
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    for i, (label, trace) in enumerate(traces.items()):
        ax.step(range(len(trace)), [t / 2**10 for t in trace], where="post", lw=1.8,
                color=RANK_COLORS[i % 8], label=label)
    ax.axhline(elem * psi / 2**10, color="black", ls=":", lw=1, label=f"full gradient ({elem} Psi)")
    ax.axhline(elem * psi / n / 2**10, color="grey", ls="--", lw=1, label=f"owned slice ({elem} Psi / N)")
    ax.set_xlabel("gradient hooks during backward (last layer first)  ->  end")
    ax.set_ylabel("gradient KiB held by this rank")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    return fig


def table1_columns(models=(7.5e9, 128e9, 1e12), n_ds=(1, 4, 16, 64, 256, 1024), stages=(1, 2)) -> list:
    """Rows (n_d, [GB for each model and stage]) of the paper's Table 1 (zerolab.theory.calculator.table1)."""
    t = calculator.table1(models, n_ds)
    return [(n_d, [t[psi][n_d][s - 1] for psi in models for s in stages]) for n_d in n_ds]
