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


STATE_COLORS = {"params": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868"}


def model_state_bars(rows: dict, psi: int, title: str = ""):
    """What one rank holds, measured: stacked bars of parameters, gradients and optimizer state,
    in bytes per parameter. rows = {engine: memory_report()}."""
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for x, (label, m) in enumerate(rows.items()):
        bottom = 0.0
        for kind, color in STATE_COLORS.items():
            h = m[kind] / psi
            ax.bar(x, h, bottom=bottom, color=color, width=0.55, edgecolor="white",
                   label=kind if x == 0 else None)
            if h >= 0.6:
                ax.text(x, bottom + h / 2, f"{h:.1f}", ha="center", va="center", color="white", fontsize=8)
            bottom += h
        ax.text(x, bottom, f"{bottom:.1f}", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(range(len(rows)), list(rows))
    ax.set_ylabel("bytes per parameter held by one rank")
    ax.set_ylim(0, 1.12 * max(sum(m[k] for k in STATE_COLORS) / psi for m in rows.values()))
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    return fig


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def optimizer_views(views: list, title: str = ""):
    """The elements of each parameter that each rank's optimizer steps, from run_optimizer_views.

    views: one list per rank of (parameter name, parameter shape, shape of the tensor the rank's
    optimizer holds). Slices are contiguous and in rank order, so each bar is the parameter, cut
    where the ranks' slices meet.
    """
    rows = list(zip(*views))                  # per parameter: one (name, shape, held) per rank
    fig, ax = plt.subplots(figsize=(8, 0.28 * len(rows) + 1.3))
    for y, per_rank in enumerate(rows):
        name, shape = per_rank[0][0], per_rank[0][1]
        total, left = _numel(shape), 0
        for r, (_, _, held) in enumerate(per_rank):
            k = _numel(held)
            if k:
                ax.barh(y, k, left=left, color=RANK_COLORS[r % 8], height=0.7)
                left += k
        kept = [r for r, (_, _, held) in enumerate(per_rank) if _numel(held)]
        how = f"whole on rank {kept[0]}" if len(kept) == 1 else "cut: " + " + ".join(
            f"{_numel(per_rank[r][2]):,}" for r in kept)
        ax.text(total * 1.01, y, how, va="center", fontsize=7)
        assert left == total, (name, left, total)
    for r in range(len(views)):
        ax.barh(0, 0, color=RANK_COLORS[r % 8], label=f"stepped by rank {r}")
    ax.set_yticks(range(len(rows)), [f"{r[0][0]} {tuple(r[0][1])}" for r in rows], fontsize=7)
    ax.invert_yaxis()
    longest = max(_numel(r[0][1]) for r in rows)
    ax.set_xlim(0, longest * 1.35)
    ax.set_xlabel("elements of the parameter")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return fig


def state_shares(shares: dict, formula: float, title: str = ""):
    """Optimizer-state bytes each rank holds, per optimizer: shares = {optimizer: [bytes per rank]};
    formula: K Psi / N bytes, the even share."""
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    n = max(len(v) for v in shares.values())
    width = 0.8 / n
    for x, (label, per_rank) in enumerate(shares.items()):
        for r, b in enumerate(per_rank):
            pos = x - 0.4 + width * (r + 0.5)
            ax.bar(pos, b / 2**10, width=width * 0.92, color=RANK_COLORS[r % 8],
                   label=f"rank {r}" if x == 0 else None)
            ax.text(pos, b / 2**10, f"{b / 2**10:,.0f}", ha="center", va="bottom", fontsize=7)
    ax.axhline(formula / 2**10, color="black", ls="--", lw=1, label="K Psi / N (an even share)")
    ax.set_xticks(range(len(shares)), list(shares), fontsize=8)
    ax.set_ylabel("optimizer state held (KiB)")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    return fig
