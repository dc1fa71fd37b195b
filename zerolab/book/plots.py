"""Figures for the memory chapters, drawn from measurements handed in by the caller."""

from __future__ import annotations

import matplotlib.pyplot as plt

from .. import memory

COLORS = {"params": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868",
          "activations": "#C44E52", "other": "#8172B3"}
STAGE_NAMES = {0: "DP (no ZeRO)", 1: "ZeRO-1 $P_{os}$", 2: "ZeRO-2 $P_{os+g}$", 3: "ZeRO-3 $P_{os+g+p}$"}


def memory_breakdown(measured: dict, predicted: dict, title: str = "", unit: float = 2**20,
                     unit_name: str = "MiB"):
    """Two stacked bars: what was measured, and what the formula predicts, piece by piece."""
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    bars = {"measured": measured, "formula": predicted}
    for x, (label, parts) in enumerate(bars.items()):
        bottom = 0.0
        for key in ("params", "grads", "optimizer", "activations"):
            if key not in parts:
                continue
            height = parts[key] / unit
            ax.bar(x, height, bottom=bottom, color=COLORS[key], width=0.55,
                   label=key if x == 0 else None, edgecolor="white")
            if height > 0.04 * sum(v / unit for v in parts.values()):
                ax.text(x, bottom + height / 2, f"{key}\n{height:.2f}", ha="center", va="center",
                        fontsize=8, color="white")
            bottom += height
    ax.set_xticks(range(len(bars)), list(bars))
    ax.set_ylabel(unit_name)
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    return fig


def per_device_vs_nd(psi: float, n_ds=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
                     device_gb: float | None = 32.0, k: float = 12):
    """Model-state memory per device against the data-parallel degree, one line per stage."""
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for stage in (0, 1, 2, 3):
        ys = [memory.model_state_bytes(psi, n, stage, k) / 1e9 for n in n_ds]
        ax.plot(n_ds, ys, marker="o", markersize=3, label=STAGE_NAMES[stage])
    if device_gb:
        ax.axhline(device_gb, color="black", linestyle="--", linewidth=1)
        ax.text(n_ds[0], device_gb * 1.15, f"{device_gb:g} GB device", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("data-parallel degree $N_d$")
    ax.set_ylabel("model states per device (GB)")
    ax.set_title(f"$\\Psi$ = {psi / 1e9:g}B parameters, K = {k:g}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def line(xs, ys, xlabel: str, ylabel: str, title: str = "", fit=None):
    """A measured series, optionally with a fitted or predicted line beside it."""
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    ax.plot(xs, ys, "o", label="measured")
    if fit is not None:
        ax.plot(xs, [fit(x) for x in xs], "-", label="fit")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    return fig
