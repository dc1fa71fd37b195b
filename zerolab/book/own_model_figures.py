"""Figures for chapter 11 (your own model), each drawn from what a cell of the chapter already ran.

    script_figure(before, after)            the plain script and its zerolab version, line by line
    habits_figure(tried)                    what each precision habit does on an engine, and the bytes it sends
    equivalence_figure(ref, runs)           every engine's losses against one process on the global batch
    memory_figure(mem, psi, n)              each engine's model states by kind against the paper's formula
    resume_figure(saved, resumed, on_one)   a run resumed from a checkpoint, against the run never stopped
    accumulation_figure(mem, psi, n)        gradient bytes with one and two micro-batches per step
    activations_figure(act)                 model states and activations at two batch sizes
    loss_scale_figure(over)                 fp16's loss scale collapsing, bf16 training on
"""

from __future__ import annotations

import difflib

import matplotlib.pyplot as plt

from .own_model_demo import LABELS

ENGINES = ("naive", "ddp", "zero1", "zero2", "zero3")
KINDS = (("params", "#4C72B0"), ("grads", "#DD8452"), ("optimizer", "#55A868"))


def line_status(before: list[str], after: list[str]) -> tuple[list[str], list[str]]:
    """Each line of both files as 'same', 'removed' (before only) or 'added' (after only), as difflib matches
    them: the lines a reader must change to move the script."""
    left, right = ["same"] * len(before), ["same"] * len(after)
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, before, after, autojunk=False).get_opcodes():
        if tag != "equal":
            left[i1:i2] = ["removed"] * (i2 - i1)
            right[j1:j2] = ["added"] * (j2 - j1)
    return left, right


def _block_starts(status: list[str], least: int = 2) -> list[int]:
    """The first line of every run of at least `least` changed lines."""
    starts, k = [], 0
    while k < len(status):
        if status[k] != "same":
            end = k
            while end < len(status) and status[end] != "same":
                end += 1
            if end - k >= least:
                starts.append(k)
            k = end
        else:
            k += 1
    return starts


def script_figure(before: list[str], after: list[str], names=("train_plain.py", "train_zerolab.py")):
    """Both files side by side, one bar per line as long as the line: grey where the line is the same in both,
    red where only the plain script has it, green where only the zerolab script has it."""
    status = line_status(before, after)
    colors = {"same": "#c8c8c8", "removed": "#C44E52", "added": "#55A868"}
    fig, axes = plt.subplots(1, 2, figsize=(12, 6), sharey=True)
    for ax, lines, st, name in zip(axes, (before, after), status, names):
        ax.barh(range(len(lines)), [len(x.rstrip()) for x in lines], color=[colors[s] for s in st], height=0.85)
        for start in _block_starts(st):         # name each changed block by its first line of code
            first = next((k for k in range(start, len(lines)) if lines[k].strip()), start)
            label = lines[first].split("  #")[0].strip()
            ax.text(len(lines[first].rstrip()) + 1, first, label[:40] + ("..." if len(label) > 40 else ""),
                    fontsize=6, family="monospace", va="center",
                    bbox={"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.85})
        changed = sum(s != "same" for s in st)
        ax.set_title(f"{name}: {len(lines)} lines, {changed} of them only here", fontsize=9)
        ax.set_xlim(0, 190)
        ax.set_xlabel("characters in the line")
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_ylabel("line number")
    axes[0].invert_yaxis()
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, ["in both files", "plain script only", "zerolab script only"], loc="lower center", ncol=3,
               frameon=False, fontsize=8)
    fig.suptitle("Moving a script to zerolab: what stays and what changes, line by line", fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


def habits_figure(tried: dict):
    """One row per habit: the gradient bytes rank 0 sent in its step, or a red mark where the engine refused it."""
    habits = list(tried)
    fig, ax = plt.subplots(figsize=(8.5, 3.2))
    for j, h in enumerate(habits):
        outcome, sent = tried[h]
        if sent is None:
            ax.plot([0], [j], "x", color="#C44E52", ms=10, mew=2)
            ax.text(max(v for _, v in tried.values() if v) / 1e3 * 0.02, j, "  refused at its first step, with the fix named",
                    va="center", fontsize=8, color="#C44E52")
        else:
            ax.barh(j, sent / 1e3, color="#4C72B0")
            ax.text(sent / 1e3, j, f" {sent:,} B: {outcome}", va="center", fontsize=8)
    ax.set_yticks(range(len(habits)), habits, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.6 * max(v for _, v in tried.values() if v) / 1e3)
    ax.set_xlabel("gradient bytes rank 0 sent in the step (kB)")
    ax.set_title("Precision habits on an engine, 2 ranks (ZeRO-2 unless the row says zl.DDP)", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


def equivalence_figure(ref: dict, runs: list, tolerance: float = 1e-5):
    """Left: each engine's loss per step (the mean of its ranks') over the reference's. Right: how far each is from
    the reference, per step, on a log scale, against the tolerance the chapter asserts."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.4))
    steps = range(len(ref["losses"]))
    a.plot(steps, ref["losses"], "k-", lw=4, alpha=0.25, label="one process, global batch")
    floor = tolerance * 1e-4
    for k, name in enumerate(ENGINES):
        mean = [sum(r[name]["losses"][s] for r in runs) / len(runs) for s in steps]
        a.plot(steps, mean, "o", ms=7 - k, label=LABELS[name])
        diff = [max(abs(m - c), floor) for m, c in zip(mean, ref["losses"])]
        b.semilogy(steps, diff, "o-", ms=5, label=LABELS[name])
    b.axhline(tolerance, color="#C44E52", ls="--", lw=1)
    b.text(0, tolerance * 1.4, f"tolerance {tolerance:g}", color="#C44E52", fontsize=8)
    b.set_ylim(floor / 3, tolerance * 30)
    b.set_yticks([floor, tolerance / 100, tolerance], ["0 (equal)", f"{tolerance / 100:g}", f"{tolerance:g}"])
    a.set_title("loss per step: every engine on the reference", fontsize=9)
    b.set_title("|engine's loss - reference's|", fontsize=9)
    for ax in (a, b):
        ax.set_xlabel("optimizer step")
        ax.set_xticks(list(steps))
        ax.grid(alpha=0.3)
    a.set_ylabel("loss (nats per token)")
    b.set_ylabel("difference (log scale)")
    a.legend(fontsize=7)
    fig.tight_layout()
    return fig


def memory_figure(mem_rank0: dict, formula: dict):
    """Stacked bars of what each engine holds on rank 0 (memory_report: parameters, gradients, optimizer state),
    with the paper's formula for that stage as a black tick. mem_rank0: {engine: memory_report()}."""
    names = [n for n in ENGINES if n in mem_rank0]
    fig, ax = plt.subplots(figsize=(8, 3.2))
    for j, n in enumerate(names):
        left = 0
        for kind, color in KINDS:
            v = mem_rank0[n][kind] / 1e3
            ax.barh(j, v, left=left, color=color, label=kind if j == 0 else None)
            left += v
        ax.plot([formula[n] / 1e3] * 2, [j - 0.42, j + 0.42], "k-", lw=2.5, label="formula" if j == 0 else None)
    ax.set_yticks(range(len(names)), [LABELS[n] for n in names])
    ax.invert_yaxis()
    ax.set_xlabel("model states on rank 0 (kB), bf16 + AdamW, N = 2")
    ax.set_title("What each engine keeps on a rank, measured, against the paper's formula", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


def resume_figure(saved: list, resumed: list, on_one: list, first: int = 2):
    """The uninterrupted run's loss per step (the mean of its ranks'), and the runs resumed from its checkpoint at
    step `first`: the same engine, another stage, and one process."""
    fig, ax = plt.subplots(figsize=(7, 3.2))
    n = len(saved)
    steps = range(len(saved[0]["losses"]))
    ax.plot(steps, [sum(r["losses"][s] for r in saved) / n for s in steps], "k-", lw=5, alpha=0.25,
            label="ZeRO-3, 2 ranks, never stopped")
    later = range(first, first + len(on_one))
    for key, label, marker in (("zero3", "resumed as ZeRO-3, 2 ranks", "o"), ("zero1", "resumed as ZeRO-1, 2 ranks", "s")):
        ax.plot(later, [sum(r[key][i] for r in resumed) / n for i in range(len(on_one))], marker, ms=8, label=label)
    ax.plot(later, on_one, "^", ms=8, label="resumed as one process")
    ax.axvline(first - 0.5, color="#8c8c8c", ls=":", lw=1)
    ax.text(first - 0.45, ax.get_ylim()[1], " checkpoint", va="top", fontsize=8, color="#555555")
    ax.set_xticks(list(steps))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (mean of the ranks')")
    ax.set_title("Save at step 2, load into fresh engines, train on", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def accumulation_figure(grads: dict, formula: dict):
    """Gradient bytes on rank 0 with one and with two micro-batches per step, beside the formula's.
    grads: {A: {engine: bytes}}; formula: {engine: bytes}."""
    names = [n for n in ENGINES if n in formula]
    fig, ax = plt.subplots(figsize=(8, 3))
    width = 0.38
    for i, (a, row) in enumerate(sorted(grads.items())):
        ax.bar([k + (i - 0.5) * width for k in range(len(names))], [row[n] / 1e3 for n in names], width * 0.95,
               label=f"A = {a} micro-batch{'es' if a > 1 else ''} per step", color=["#4C72B0", "#DD8452"][i])
    ax.plot(range(len(names)), [formula[n] / 1e3 for n in names], "k_", ms=30, mew=2.5, label="formula: one bf16 "
            "gradient")
    ax.set_xticks(range(len(names)), [LABELS[n] for n in names])
    ax.set_ylabel("gradient bytes on rank 0 (kB)")
    ax.set_title("Accumulating in bf16 would lose bits: ZeRO-2 and ZeRO-3 add an fp32 accumulator", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", markerscale=0.4)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def activations_figure(act: dict):
    """Model states and activations per rank at each number of sequences per rank (act: {rows: memory_report})."""
    rows = sorted(act)
    fig, ax = plt.subplots(figsize=(7, 2.8))
    y = range(len(rows))
    states = [act[r]["total"] / 1e6 for r in rows]
    acts = [act[r]["activations"] / 1e6 for r in rows]
    ax.barh(y, states, color="#4C72B0", label="model states")
    ax.barh(y, acts, left=states, color="#C44E52", label="activations")
    ax.set_yticks(list(y), [f"{r} sequences per rank" for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("MB on rank 0, ZeRO-3, N = 2, fp32")
    ax.set_title("The formula's model states stay; the activations grow with the tokens", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


def loss_scale_figure(over: dict):
    """fp16's loss scale per step (log scale), each step marked applied, skipped or raised; bf16's steps beside."""
    fig, ax = plt.subplots(figsize=(7.5, 3))
    fp16 = over["fp16"]["rows"]
    ax.semilogy([s for s, *_ in fp16], [sc for _, sc, *_ in fp16], "-", color="#8c8c8c", lw=1)
    marks = {True: ("o", "#55A868", "applied"), False: ("x", "#C44E52", "skipped (overflow)"),
             "raised": ("X", "black", "raised FloatingPointError")}
    seen = set()
    for step, scale, applied, _ in fp16:
        m, c, label = marks[applied]
        ax.semilogy([step], [scale], m, color=c, ms=10, mew=2, label=None if label in seen else label)
        seen.add(label)
    for step, _, applied, _ in over["bf16"]["rows"]:
        ax.plot([step], [0.5], "o", color="#55A868" if applied is True else "#C44E52", ms=8)
    ax.text(0, 0.62, "bf16 (no scale): every step applied", fontsize=8, color="#555555")
    ax.set_ylim(0.35, 40)
    ax.set_yticks([1, 2, 4, 8, 16], ["1", "2", "4", "8", "16"])
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("fp16 loss scale")
    ax.set_title("A forward that overflows: the scale halves to its floor, then the run stops", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig
