"""Figures for chapter 9 (ZeRO-R), each drawn from measurements made by zerolab.book.zero_r_demo."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

KB = 1024
COLORS = {"params": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868",
          "device_activations": "#C44E52", "offloaded": "#8172B3"}


def residual_bars(rs: dict, title: str = "One training step of the GPT, measured"):
    """Model states beside the residual states (activations, temporaries, fragmentation)."""
    names = list(rs)
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.bar(names, [rs[n] / KB for n in names], color=["#4C72B0", "#C44E52", "#DD8452", "#8C8C8C"])
    for i, n in enumerate(names):
        ax.text(i, rs[n] / KB, f"{rs[n] / KB:.0f} KiB", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("KiB")
    ax.set_title(title)
    fig.tight_layout()
    return fig


def replicated_input(inputs: list, title: str = "The input of block 1 on each mp rank (real tensors)"):
    """Top: the full block input on every mp rank (identical). Bottom: what P_a keeps per rank."""
    n = len(inputs)
    x0 = inputs[0]["x"].numpy()
    vmax = float(np.abs(x0).max())
    fig, axes = plt.subplots(2, n, figsize=(3.2 * n, 4.6))
    for r, inp in enumerate(inputs):
        axes[0, r].imshow(inp["x"].numpy().T, cmap="RdBu", vmin=-vmax, vmax=vmax, aspect="auto")
        axes[0, r].set_title(f"mp rank {r}: whole input (T x C)", fontsize=9)
        kept = np.full(x0.size, np.nan)
        k = inp["kept"].numpy()
        kept[r * k.size:(r + 1) * k.size] = k[:max(0, min(k.size, x0.size - r * k.size))]
        axes[1, r].imshow(kept.reshape(x0.shape).T, cmap="RdBu", vmin=-vmax, vmax=vmax, aspect="auto")
        axes[1, r].set_title(f"mp rank {r}: P_a keeps 1/{n}", fontsize=9)
        for a in axes[:, r]:
            a.set_xlabel("position t")
            a.set_yticks([])
    axes[0, 0].set_ylabel("channel")
    axes[1, 0].set_ylabel("channel")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def activation_bars(rows: dict, title: str = "Bytes held for backward at the end of forward, per rank"):
    """rows: {label: {"device_activations": b, "offloaded": b}} -> stacked bars."""
    labels = list(rows)
    dev = [rows[k]["device_activations"] / KB for k in labels]
    off = [rows[k]["offloaded"] / KB for k in labels]
    fig, ax = plt.subplots(figsize=(8, 3.2))
    ax.bar(labels, dev, color=COLORS["device_activations"], label="on the device")
    ax.bar(labels, off, bottom=dev, color=COLORS["offloaded"], hatch="//", label="in the offload pool (CPU)")
    ax.set_ylabel("KiB")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    return fig


def comm_bars(rows: dict, title: str = "Bytes sent per step by one rank, P_a at dp=2 x mp=2"):
    """rows: {label: bytes}."""
    fig, ax = plt.subplots(figsize=(6, 2.6))
    labels = list(rows)
    ax.barh(labels, [rows[k] / KB for k in labels], color=["#4C72B0", "#4C72B0", "#C44E52"])
    for i, k in enumerate(labels):
        ax.text(rows[k] / KB, i, f" {rows[k] / KB:.0f} KiB", va="center", fontsize=9)
    ax.set_xlabel("KiB")
    ax.set_title(title)
    fig.tight_layout()
    return fig


def buffer_curve(rows: list, bucket_mb: float, title: str = "Stage 2's communication buffers as the model grows"):
    psi = [r["psi"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    ax.plot(psi, [r["fused"] / KB for r in rows], "o-", label="one fused buffer (grows with $\\Psi$)")
    ax.plot(psi, [r["bucketed"] / KB for r in rows], "s-", label=f"zerolab, bucket_mb={bucket_mb} ($C_B$)")
    ax.set_xlabel("parameters $\\Psi$")
    ax.set_ylabel("largest buffer pool (KiB)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def defrag_bars(table: dict, title: str = "The allocator model on one real step, without and with M_D"):
    names = ["without M_D", "with M_D"]
    fig, ax = plt.subplots(figsize=(6, 3))
    x = np.arange(2)
    ax.bar(x - 0.2, [table[n]["peak_live"] / KB for n in names], 0.4, label="peak live (perfect packing)")
    ax.bar(x + 0.2, [table[n]["reserved"] / KB for n in names], 0.4, label="reserved by the allocator model")
    ax.set_xticks(x, names)
    ax.set_ylabel("KiB")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


def table3(configs: dict, title: str = "The paper's Table 3 at small scale: measured bytes per rank (dp=2, mp=2)"):
    """configs: {"C1": memory report with device_activations and offloaded}."""
    names = list(configs)
    fig, ax = plt.subplots(figsize=(8, 3.6))
    bottom = np.zeros(len(names))
    for key, label in (("params", "parameters"), ("grads", "gradients"), ("optimizer", "optimizer state"),
                       ("device_activations", "activations on the device"),
                       ("offloaded", "checkpoints offloaded to CPU")):
        vals = np.array([configs[n][key] / KB for n in names])
        ax.bar(names, vals, bottom=bottom, color=COLORS[key], label=label,
               hatch="//" if key == "offloaded" else None)
        bottom += vals
    ax.set_ylabel("KiB")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, bbox_to_anchor=(1.01, 1), loc="upper left")
    fig.tight_layout()
    return fig
