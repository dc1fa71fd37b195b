"""Figures for chapter 3 ("Where did all the memory go?"), drawn from what its cells measured or
computed and handed in here; nothing is typed in by hand."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from .plots import COLORS

MiB = 2**20
GB = 1e9


def plot_attention_bytes(lengths, fused, written_out, n_layer: int, batch: int, n_head: int):
    """Activation bytes saved for backward against the sequence length, with attention fused and
    written out (left), and what writing it out adds (right, log-log) beside one fp32 softmax
    output of batch x heads x seq x seq per layer: a slope of 2 against the total's 1."""
    s = np.asarray(lengths, dtype=float)
    fused, written_out = np.asarray(fused, float) / MiB, np.asarray(written_out, float) / MiB
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.6))
    ax.plot(s, written_out, "o-", color=COLORS["activations"], label="attention written out")
    ax.plot(s, fused, "s--", color=COLORS["params"], label="fused attention kernel")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("saved for backward (MiB)")
    ax.set_title(f"Activations of GPT-small, batch {batch}", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    bx.loglog(s, fused, "s--", base=2, color=COLORS["params"], label="fused kernel: all activations")
    bx.loglog(s, written_out - fused, "o-", base=2, color=COLORS["activations"],
              label="written out minus fused (measured)")
    bx.loglog(s, n_layer * batch * n_head * s**2 * 4 / MiB, "k:", base=2,
              label="layers x batch x heads x seq² x 4 B")
    bx.set_xlabel("sequence length (tokens)")
    bx.set_ylabel("MiB (log scale)")
    bx.set_title("Doubling the sequence: x2 for the fused total, x4 for the scores", fontsize=10)
    bx.legend(fontsize=8)
    bx.grid(alpha=0.3, which="both")
    fig.tight_layout()
    return fig


def plot_replicas(ranks: list):
    """What each rank of plain data parallelism holds after one step (measured per rank, stacked by
    kind), beside the bytes it sent: every rank a full copy."""
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for x, r in enumerate(ranks):
        bottom = 0.0
        for key in ("params", "grads", "optimizer"):
            height = r[key] / MiB
            ax.bar(x, height, bottom=bottom, color=COLORS[key], width=0.55, edgecolor="white",
                   label=key if x == 0 else None)
            ax.text(x, bottom + height / 2, f"{key}\n{height:.2f}", ha="center", va="center", fontsize=8,
                    color="white")
            bottom += height
        ax.text(x, bottom + 0.3, f"{bottom:.2f} MiB held\n{r['bytes_sent'] / MiB:.2f} MiB sent", ha="center",
                fontsize=8)
    ax.set_xticks(range(len(ranks)), [f"rank {r['rank']}" for r in ranks])
    ax.set_xlabel("data-parallel rank")
    ax.set_ylabel("model states (MiB)")
    ax.set_ylim(0, 1.3 * max(r["total"] for r in ranks) / MiB)
    ax.set_title(f"Plain data parallelism on {len(ranks)} ranks: each holds every model state", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


def plot_budget(bars: dict, device_bytes: float, title: str, xlabel: str = "activations"):
    """Stacked bars of a training step's memory in GB, one bar per scenario ({name: {piece: bytes}}),
    against the device's capacity (dashed)."""
    colors = {"model states": COLORS["optimizer"], "activations": COLORS["activations"],
              "fused gradient buffer": COLORS["other"]}
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for x, (name, parts) in enumerate(bars.items()):
        bottom = 0.0
        for key, value in parts.items():
            ax.bar(x, value / GB, bottom=bottom, color=colors[key], width=0.55, edgecolor="white",
                   label=key if x == 0 else None)
            ax.text(x, bottom + value / GB / 2, f"{value / GB:.0f}", ha="center", va="center", fontsize=8,
                    color="white")
            bottom += value / GB
        ax.text(x, bottom + 1, f"{bottom:.0f} GB", ha="center", fontsize=8)
    ax.axhline(device_bytes / GB, color="k", ls="--", lw=1)
    ax.text((len(bars) - 1) / 2, device_bytes / GB + 1, f"{device_bytes / GB:.0f} GB device", ha="center",
            fontsize=8)
    ax.set_xticks(range(len(bars)), list(bars))
    ax.set_xlabel(xlabel)
    ax.set_ylabel("memory (GB, 10^9 bytes)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    return fig
