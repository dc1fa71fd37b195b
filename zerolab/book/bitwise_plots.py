"""Chapter 5's figures of the bitwise mode (zerolab.bitwise).

* `drift_figure(bits)`: bits that differ from one process, per tensor, against the world size,
  for the default path and the bitwise mode (from bitwise_demo.world_size_runs);
* `halving_rounds(world_size)`: which shards each rank holds after each round of recursive
  halving, and its partner in that round (the index arithmetic of zerolab.bitwise.tree);
* `fixed_tree_figure(num_chunks, world_size)`: the chunks' one binary tree, coloured by the rank
  that owns each chunk (zerolab.bitwise.ChunkPlan), above the rounds of recursive halving;
* `cost_figure(rows)`: bytes per step (measured and closed form) and step time against the ring,
  from zerolab.bitwise.cost.measure_cost;
* `engines_figure(bits, numel)`: bits that differ from one process, by engine (zl.DDP, ZeRO-1, 2, 3)
  and world size, default mode beside bitwise mode (from bitwise_engines.engine_runs).
"""

from __future__ import annotations

import math

from zerolab.bitwise import ChunkPlan

RANK_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]
ACROSS_COLOR = "#333333"
ENGINES = {"ring": ("ring all-reduce (zl.DDP)", "#4C72B0"),
           "bitwise": ("bitwise, each rank's chunks in a run", "#55A868"),
           "bitwise_interleaved": ("bitwise, chunks interleaved", "#C44E52")}


def drift_figure(bits: dict, world_sizes=(2, 4, 8)):
    """bits: {"default" | "bitwise": {N: differing_bits(...)}}. One heat map: a row per tensor, a
    column per mode and world size; the colour (log scale) and the number are the differing bits."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    names = list(bits["default"][world_sizes[0]])
    columns = [(mode, n) for mode in ("default", "bitwise") for n in world_sizes]
    grid = [[bits[mode][n][name]["bits"] for mode, n in columns] for name in names]
    top = max(max(row) for row in grid)
    fig, ax = plt.subplots(figsize=(7.5, 0.9 + 0.24 * len(names)))
    masked = [[v if v > 0 else float("nan") for v in row] for row in grid]
    image = ax.imshow(masked, aspect="auto", cmap="Oranges", norm=LogNorm(vmin=1, vmax=max(top, 10)))
    ax.set_facecolor("#F2F2F2")                     # zero: no colour
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:,}", ha="center", va="center", fontsize=6.5,
                    color="white" if v > top ** 0.8 else "black")
    ax.axvline(len(world_sizes) - 0.5, color="black", lw=1.5)
    ax.set_xticks(range(len(columns)), [f"N = {n}" for _, n in columns], fontsize=8)
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.set_xlabel("world size N (ranks); left: default path (zl.DDP), right: bitwise mode")
    ax.set_title("Bits that differ from one process's weights after the same training", fontsize=10)
    fig.colorbar(image, ax=ax, label="differing bits in the tensor (log scale; grey: 0)", shrink=0.6)
    fig.tight_layout()
    return fig


def halving_rounds(world_size: int) -> list:
    """[{"round", "distance", "partner", "held", "ranks_summed"}], round 0 being the start.

    As zerolab.bitwise.tree_reduce_scatter: in the round at distance d (1, 2, 4, ...), rank r
    sends half of what it holds to rank r XOR d and adds the other half with what it receives.
    It keeps the shards whose bit log2(d) matches its own, so at the end it holds shard r.
    held[r]: the shards rank r holds after the round; ranks_summed[r]: the ranks whose chunks
    each of those shards now sums."""
    if world_size < 1 or world_size & (world_size - 1):
        raise ValueError(f"halving_rounds: the world size must be a power of two, got {world_size}")
    ranks = range(world_size)
    rounds = [{"round": 0, "distance": 0, "partner": [None] * world_size,
               "held": [list(range(world_size)) for _ in ranks], "ranks_summed": [[r] for r in ranks]}]
    d = 1
    while d < world_size:
        before = rounds[-1]
        held = [[j for j in before["held"][r] if (j // d) & 1 == (r // d) & 1] for r in ranks]
        summed = [[q for q in ranks if q // (2 * d) == r // (2 * d)] for r in ranks]
        rounds.append({"round": len(rounds), "distance": d, "partner": [r ^ d for r in ranks],
                       "held": held, "ranks_summed": summed})
        d *= 2
    return rounds


def _draw_tree(ax, plan: ChunkPlan) -> None:
    c, n = plan.num_chunks, plan.world_size
    owner = {chunk: r for r in range(n) for chunk in plan.chunks_of(r)}
    inside = int(math.log2(plan.chunks_per_rank))          # levels added inside a rank
    levels = int(math.log2(c))
    ax.axhspan(-0.5, inside + 0.5, color="#EAF1E4", lw=0)
    ax.axhspan(inside + 0.5, levels + 0.5, color="#ECECEC", lw=0)
    for level in range(levels + 1):
        width = 2 ** level
        for i in range(c // width):
            x, first = i * width + (width - 1) / 2, i * width
            color = RANK_COLORS[owner[first] % len(RANK_COLORS)] if level <= inside else ACROSS_COLOR
            if level:
                for child in (x - width / 4, x + width / 4):
                    ax.plot([child, x], [level - 1, level], color="#777777", lw=1, zorder=1)
            ax.scatter([x], [level], s=170 if level else 230, color=color, zorder=2, edgecolor="white")
            if level == 0:
                ax.text(x, 0, str(first), ha="center", va="center", fontsize=7, color="white", zorder=3)
                ax.text(x, -0.6, f"rank {owner[first]}", ha="center", va="top", fontsize=7,
                        color=RANK_COLORS[owner[first] % len(RANK_COLORS)])
    notes = {0: f"chunks 0 to {c - 1}: one forward and backward each"}
    for level in range(1, inside + 1):
        notes[level] = "added inside the rank, as its chunks arrive"
    for k, level in enumerate(range(inside + 1, levels + 1), start=1):
        notes[level] = f"round {k}: rank r adds with rank r XOR {2 ** (k - 1)}"
    for level, text in notes.items():
        ax.text(c - 0.3, level, text, va="center", fontsize=8)
    ax.set_xlim(-0.7, c + 5.2)
    ax.set_ylim(-1.0, levels + 0.6)
    ax.set_yticks(range(levels + 1), [f"level {lv}" for lv in range(levels + 1)], fontsize=8)
    ax.set_xticks([])
    ax.set_title(f"One tree over {c} chunks: the same additions on 1 rank or {n}", fontsize=10)
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)


def _draw_halving(ax, world_size: int) -> None:
    from matplotlib.patches import Rectangle

    rounds = halving_rounds(world_size)
    box = 0.8 / world_size
    for row, rnd in enumerate(rounds):
        y = -row
        for r in range(world_size):
            for j in range(world_size):
                x = r - 0.4 + j * box
                held = j in rnd["held"][r]
                ax.add_patch(Rectangle((x, y - 0.18), box * 0.9, 0.36, facecolor="#555555" if held else "white",
                                       edgecolor="#999999", lw=0.6))
            if row:
                ax.text(r, y - 0.3, "ranks " + "+".join(str(q) for q in rnd["ranks_summed"][r]), ha="center",
                        va="top", fontsize=7)
        if row:
            d, done = rnd["distance"], set()
            for r in range(world_size):
                p = rnd["partner"][r]
                if (p, r) in done:
                    continue
                done.add((r, p))
                ax.annotate("", xy=(p, y + 0.55), xytext=(r, y + 0.55),
                            arrowprops={"arrowstyle": "<->", "color": "#555555",
                                        "connectionstyle": f"arc3,rad={0.15 if d > 1 else 0.0}", "lw": 1})
    ax.set_xlim(-0.6, world_size - 0.4)
    ax.set_ylim(-len(rounds) + 0.45, 0.45)
    labels = ["start"] + [f"after round {k}\n(partner: r XOR {rnd['distance']})" for k, rnd in enumerate(rounds[1:], 1)]
    ax.set_yticks([-i for i in range(len(rounds))], labels, fontsize=8)
    ax.set_xticks(range(world_size), [f"rank {r}" for r in range(world_size)], fontsize=8)
    ax.set_title(f"Recursive halving: the {world_size} shards of the gradient each rank holds (dark), "
                 "and whose subtrees they sum", fontsize=10)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def fixed_tree_figure(num_chunks: int = 8, world_size: int = 4):
    """Top: the perfect binary tree over the chunks, leaves coloured by the rank that owns each
    (ChunkPlan, contiguous runs); the lower levels are added inside a rank, the top log2 N levels
    across ranks. Bottom: the rounds of recursive halving that add those top levels."""
    import matplotlib.pyplot as plt

    plan = ChunkPlan(num_chunks, world_size)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.8), gridspec_kw={"height_ratios": [1.15, 1]})
    _draw_tree(top, plan)
    _draw_halving(bottom, world_size)
    fig.tight_layout()
    return fig


def cost_figure(rows: dict):
    """rows: measure_cost's {N: {...}}. Left: bytes each rank sends per step, measured (bars) and
    closed form (black ticks). Right: step time over the ring's median step in the same run, the
    median as a bar and min to max as a line."""
    import matplotlib.pyplot as plt

    ns = sorted(rows)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    width = 0.8 / len(ENGINES)
    for k, (engine, (label, color)) in enumerate(ENGINES.items()):
        xs = [i + (k - (len(ENGINES) - 1) / 2) * width for i in range(len(ns))]
        left.bar(xs, [rows[n][engine]["bytes_per_step"] / 1e3 for n in ns], width * 0.9, color=color, label=label)
        left.scatter(xs, [rows[n][engine]["bytes_closed_form"] / 1e3 for n in ns], marker="_", s=300,
                     color="black", zorder=3, label="closed form" if k == 0 else None)
        ring = [rows[n]["ring"]["step_s"]["median"] for n in ns]
        spread = [rows[n][engine]["step_s"] for n in ns]
        med = [s["median"] / r for s, r in zip(spread, ring)]
        lo = [m - s["min"] / r for m, s, r in zip(med, spread, ring)]
        hi = [s["max"] / r - m for m, s, r in zip(med, spread, ring)]
        right.bar(xs, med, width * 0.9, color=color, yerr=[lo, hi], capsize=3, ecolor="black", label=label)
    for ax in (left, right):
        ax.set_xticks(range(len(ns)), [f"N = {n}" for n in ns])
        ax.set_xlabel("world size N (ranks, gloo on CPU)")
    right.axhline(1.0, color="black", lw=0.8, ls="--")
    left.set_ylabel("bytes each rank sends per step (kB)")
    left.set_title("Bytes per step: measured and closed form", fontsize=10)
    right.set_ylabel("step time / ring's median step")
    right.set_title("Step time against the ring (median; min to max)", fontsize=10)
    handles, labels = left.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


ENGINE_COLORS = {"ddp": "#4C72B0", "zero1": "#DD8452", "zero2": "#55A868", "zero3": "#C44E52"}


def engines_figure(bits: dict, numel: int):
    """bits: bitwise_engines.engine_runs's {"default" | "bitwise": {engine: {N: totals}}}. Two
    panels with one y axis: bits that differ from one process's weights, a bar per engine at each
    world size; left the default mode, right the bitwise mode (each of its bars labelled with its
    count, which is 0 when the mode holds)."""
    import matplotlib.pyplot as plt

    from zerolab.book import bitwise_engines

    engines = list(bits["default"])
    ns = sorted(bits["default"][engines[0]])
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    width = 0.8 / len(engines)
    for ax, mode in zip(axes, ("default", "bitwise")):
        for k, engine in enumerate(engines):
            label, color = bitwise_engines.ENGINES[engine], ENGINE_COLORS[engine]
            xs = [i + (k - (len(engines) - 1) / 2) * width for i in range(len(ns))]
            ys = [bits[mode][engine][n]["bits"] for n in ns]
            ax.bar(xs, ys, width * 0.9, color=color, label=label)
            if mode == "bitwise":
                for x, y in zip(xs, ys):
                    ax.text(x, y, f"{y:,}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(ns)), [f"N = {n}" for n in ns])
        ax.set_xlabel("world size N (ranks, gloo on CPU)")
    axes[0].set_ylabel(f"bits that differ (count, over {numel:,} weights)")
    axes[0].yaxis.set_major_formatter(lambda v, _: f"{v:,.0f}")
    axes[0].set_title("Default mode (bitwise=False)", fontsize=10)
    axes[1].set_title("Bitwise mode (bitwise=True)", fontsize=10)
    fig.suptitle("Bits that differ from one process's weights, by engine and world size", fontsize=11)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig
