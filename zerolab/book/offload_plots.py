"""Chapter 13's figures: where the bytes live, what each step moves on each link, and where a
step's time goes, by offload mode; and the GPU run's host step beside DeepSpeed's."""

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
    ax.set_title("Where the model states live, by tier", fontsize=10)
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
    ax.set_title("Where a step's time goes, by mode (this machine's CPU)", fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False, fontsize=8)
    fig.tight_layout()
    return fig


def timeline(runs: dict):
    """One step from disk, per run (e.g. prefetch 1 and 0): the main thread (forward + backward,
    then the step; black: blocked on the disk) above the I/O thread (green: reads, purple:
    writes). A read drawn under blue or orange was hidden behind compute."""
    fig, axes = plt.subplots(len(runs), 1, figsize=(8.5, 1.5 * len(runs) + 0.6), sharex=True)
    axes = [axes] if len(runs) == 1 else list(axes)
    for ax, (label, t) in zip(axes, runs.items()):
        t0 = t["start"]
        ax.broken_barh([(0, t["backward_end"] - t0)], (1.1, 0.8), color="#4c72b0")
        ax.broken_barh([(t["backward_end"] - t0, t["end"] - t["backward_end"])], (1.1, 0.8), color="#dd8452")
        for what, color, lane in (("wait", "k", 1.1), ("read", "#55a868", 0.1), ("write", "#8172b2", 0.1)):
            spans = [(a - t0, b - a) for kind, _, a, b in t["events"] if kind == what]
            ax.broken_barh(spans, (lane, 0.8), color=color)
        ax.set_yticks([0.5, 1.5], ["I/O thread", "main thread"])
        ax.set_title(label, fontsize=9, loc="left")
    axes[-1].set_xlabel("seconds since the step began")
    fig.suptitle("One step from disk: the main thread and the I/O thread", fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("#4c72b0", "#dd8452", "k", "#55a868", "#8172b2")]
    fig.legend(handles, ["forward + backward", "step", "waiting for the disk", "read", "write"],
               loc="lower center", ncol=5, frameon=False, fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


LINKS = (("network", "network\n(engine.comm)"), ("d2h", "device -> host"), ("h2d", "host -> device"),
         ("read", "disk read"), ("written", "disk written"))


def traffic(measured: dict, closed: dict):
    """Bytes one rank moves per step on each link, one bar per mode; a black tick on a bar marks
    its closed form. measured: {mode label: {link: bytes}} (links: network, d2h, h2d, read,
    written); closed: {mode label: {link: bytes}} for the links that have one."""
    import numpy as np
    fig, ax = plt.subplots(figsize=(8.5, 3.3))
    labels = list(measured)
    width = 0.8 / len(labels)
    x = np.arange(len(LINKS))
    cmap = plt.get_cmap("tab10")
    for i, label in enumerate(labels):
        xs = x - 0.4 + width * (i + 0.5)
        ax.bar(xs, [measured[label][key] / 1e3 for key, _ in LINKS], width, color=cmap(i), label=label)
        for xi, (key, _) in zip(xs, LINKS):
            if key in closed.get(label, {}):
                ax.plot([xi - width / 2, xi + width / 2], [closed[label][key] / 1e3] * 2, color="black", lw=1.5)
    ax.plot([], [], color="black", lw=1.5, label="closed form")
    ax.set_xticks(x, [name for _, name in LINKS], fontsize=8)
    ax.set_ylabel("kB per step, rank 0")
    ax.set_title("What one step moves on each link (nano GPT, bf16, 2 ranks)", fontsize=10)
    ax.legend(loc="upper left", fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def gpu_host_step(h200: dict):
    """The offloaded step on a GPU box with the same host threads for both engines (from
    zerolab.book.gpu_results_ch11_13.h200_host_step): whole iteration, step and update alone,
    zerolab (fused and foreach AdamW) beside DeepSpeed (CPU-Adam), medians with min-max bars."""
    rows = h200["rows"]
    groups = (("whole iteration", "zl iteration, fused", "zl iteration, foreach", "DeepSpeed ZeRO-2 offload iteration"),
              ("the step", "zl step, fused", "zl step, foreach", "DeepSpeed ZeRO-2 offload step"),
              ("the update alone", "AdamW fused, alone", "AdamW foreach, alone", "DeepSpeedCPUAdam, alone"))
    series = (("zerolab, AdamW(fused=True)", 1, "#4c72b0"), ("zerolab, AdamW foreach (torch's default)", 2, "#a6bddb"),
              ("DeepSpeed, CPU-Adam", 3, "#dd8452"))
    fig, ax = plt.subplots(figsize=(9.5, 3.2))
    for j, (label, col, color) in enumerate(series):
        for i, group in enumerate(groups):
            r = rows[group[col]]
            y = i + (j - 1) * 0.27
            ax.barh(y, r["median"], height=0.25, color=color, label=label if i == 0 else None)
            ax.errorbar(r["median"], y, xerr=[[r["median"] - r["min"]], [r["max"] - r["median"]]], color="black",
                        lw=0.8, capsize=2)
    ax.set_yticks(range(len(groups)), [g[0] for g in groups])
    ax.invert_yaxis()
    ax.set_xlabel(f"milliseconds (median of {rows['zl step, fused']['rounds']} rounds; bars: min-max)")
    ax.set_title(f"The offloaded step on an {h200['machine']['device']}, {h200['threads']} host threads for both",
                 fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    fig.tight_layout()
    return fig
