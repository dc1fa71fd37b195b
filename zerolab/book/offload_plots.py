"""Chapter 13's figures: where the bytes live, and where a step's time goes, by offload mode."""

from __future__ import annotations

import statistics

import matplotlib.pyplot as plt

TIER_COLORS = {"device": "#4c72b0", "host": "#dd8452", "disk": "#55a868"}


def tiers(rows: dict):
    """Stacked bars: the model-state bytes one rank keeps on the device, in host memory and in
    files, per mode. rows: {label: {"device": b, "host": b, "disk": b}}."""
    fig, ax = plt.subplots(figsize=(8, 2.8))
    labels = list(rows)
    for i, label in enumerate(labels):
        left = 0
        for tier, color in TIER_COLORS.items():
            v = rows[label][tier] / 1024
            ax.barh(i, v, left=left, color=color, label=tier if i == 0 else None)
            left += v
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("KiB of model states on rank 0 (between steps)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    fig.tight_layout()
    return fig


def step_time(runs: dict):
    """Median step time per mode, split into forward+backward and the step; hatched: the time
    the main thread waited for the disk. Beside each disk bar, the I/O thread's busy time: the
    part of it not waited for was hidden behind compute."""
    fig, ax = plt.subplots(figsize=(8.5, 3.2))
    labels = list(runs)
    labelled = set()

    def once(name):                     # each legend entry once
        if name in labelled:
            return None
        labelled.add(name)
        return name

    for i, label in enumerate(labels):
        r = runs[label]
        med = lambda xs: statistics.median(xs[1:]) if len(xs) > 1 else (xs[0] if xs else 0.0)
        fb, total = med(r["fb_times"]), med(r["times"])
        ax.barh(i, fb, color="#4c72b0", label=once("forward + backward"))
        ax.barh(i, total - fb, left=fb, color="#dd8452", label=once("step (optimizer)"))
        if r["disk_busy"]:
            fbw, w = med(r["fb_disk_wait"]), med(r["disk_wait"])
            ax.barh(i, fbw, color="none", hatch="///", edgecolor="k", linewidth=0)
            ax.barh(i, w - fbw, left=fb, color="none", hatch="///", edgecolor="k", linewidth=0,
                    label=once("waiting for the disk"))
            ax.barh(i + 0.38, med(r["disk_busy"]), height=0.18, color="#55a868", label=once("I/O thread busy"))
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("seconds per step (median of steps 2 and 3)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False, fontsize=8)
    fig.tight_layout()
    return fig
