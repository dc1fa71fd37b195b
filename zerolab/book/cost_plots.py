"""Figures and tables of the cost model (chapters 4 and 5), and of measured timings with their spread.

* `collective_times_figure(cluster)`: the alpha-beta ring model's time and bus bandwidth against
  message size, for the three collectives, inside one node and across nodes;
* `spread(samples)`: median, min and max of repeated timings, the way the book quotes them;
* `measured_times_figure(sizes, runs)`: measured all-reduce times with their spread;
* `ddp_overlap_rows(...)`: when backward hides DDP's all-reduce, per number of GPUs.
"""

from __future__ import annotations

import statistics

from ..theory import cost_model as cm

COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3"]


def message_sizes(lo: float = 1e3, hi: float = 1e10, per_decade: int = 4) -> list:
    """Byte sizes spread evenly on a log scale, from lo to hi."""
    import math
    n = int(round(math.log10(hi / lo) * per_decade))
    return [lo * 10 ** (i / per_decade) for i in range(n + 1)]


def collective_times_figure(cluster: cm.Cluster = cm.H100_CLUSTER, intra_ns=(2, 4, 8),
                            inter_ns=(16, 64, 512)):
    """Four panels: time (top) and bus bandwidth (bottom) against message size S, inside one
    node (left, NVLink) and across nodes (right, NVLink and the nodes' network cards). Solid:
    all-reduce (NCCL's faster of ring and tree); dashed: reduce-scatter and all-gather (rings),
    which the model gives the same bandwidth term. The dotted line is the ring's bus bandwidth
    for large messages (cost_model.ring_bus_bandwidth)."""
    import matplotlib.pyplot as plt

    sizes = message_sizes()
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.4), sharex=True)
    for col, (ns, title) in enumerate([(intra_ns, f"inside one node: {cluster.nvlink.name}"),
                                       (inter_ns, f"across nodes: NVLink + {cluster.nics_per_node} x {cluster.nic.name}")]):
        top, bottom = axes[0][col], axes[1][col]
        for color, n in zip(COLORS, ns):
            for kind, style in (("all_reduce", "-"), ("reduce_scatter", "--")):
                t = [cm.collective_seconds(kind, s, n, cluster) for s in sizes]
                label = f"N={n} " + ("all-reduce" if kind == "all_reduce" else "reduce-scatter / all-gather")
                top.plot(sizes, t, style, color=color, label=label)
                bottom.plot(sizes, [cm.bus_bandwidth(kind, s, n, x) / 1e9 for s, x in zip(sizes, t)],
                            style, color=color)
        limit = cm.ring_bus_bandwidth(ns[-1], cluster) / 1e9
        bottom.axhline(limit, color="black", linewidth=0.8, linestyle=":")
        bottom.text(sizes[0], limit * 1.05, f"ring's bus bandwidth, {limit:.0f} GB/s", fontsize=8)
        top.set_title(title, fontsize=9)
        top.set_yscale("log")
        top.set_ylabel("time (s)")
        bottom.set_ylabel("bus bandwidth (GB/s)")
        bottom.set_ylim(0, limit * 1.25)
        for ax in (top, bottom):
            ax.set_xscale("log")
            ax.grid(True, which="major", alpha=0.3)
        bottom.set_xlabel("message size S (bytes of the full tensor)")
        top.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig


def spread(samples) -> dict:
    """Median, min and max of repeated measurements, and the max/min ratio."""
    samples = list(samples)
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples),
            "ratio": max(samples) / min(samples), "n": len(samples)}


def measured_times_figure(sizes_bytes, runs: dict):
    """runs: {N: [[seconds of each repeat] per size]}. The median as a line, min to max as a band."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for color, (n, per_size) in zip(COLORS, runs.items()):
        stats = [spread(r) for r in per_size]
        ax.plot(sizes_bytes, [s["median"] * 1e3 for s in stats], "o-", color=color, markersize=3,
                label=f"N={n}: median")
        ax.fill_between(sizes_bytes, [s["min"] * 1e3 for s in stats], [s["max"] * 1e3 for s in stats],
                        color=color, alpha=0.25, label=f"N={n}: min to max of {stats[0]['n']} repeats")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("message size S (bytes)")
    ax.set_ylabel("all-reduce time (ms)")
    ax.set_title("gloo all-reduce on this machine's shared CPU cores (an illustration)", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    return fig


def ddp_overlap_rows(psi: float, ns, tokens_per_rank: float, cluster: cm.Cluster = cm.H100_CLUSTER,
                     bytes_per_element: int = 2) -> list:
    """One row per number of GPUs: the all-reduce of psi bf16 gradients against the backward of
    tokens_per_rank tokens, the exposed time, and the tokens per GPU above which it is hidden."""
    rows = []
    for n in ns:
        est = cm.step_estimate(0, psi, n, tokens_per_rank, cluster, bytes_per_element)
        nodes = -(-n // cluster.gpus_per_node)
        rows.append({"n": n, "link": "NVLink (one node)" if nodes == 1 else f"NVLink + network ({nodes} nodes)",
                     "all_reduce_ms": est.comm_s * 1e3,
                     "backward_ms": cm.BACKWARD_SHARE * est.compute_s * 1e3,
                     "exposed_ms": est.exposed_s * 1e3,
                     "hidden_pct": 100 * est.hidden_fraction,
                     "tokens_to_hide": cm.min_tokens_to_hide(0, psi, n, cluster, bytes_per_element)})
    return rows


def markdown_table(rows, columns) -> str:
    """columns: [(header, key, format)]: a Markdown table of the rows."""
    head = "| " + " | ".join(h for h, _, _ in columns) + " |"
    rule = "|" + "|".join(":---" if f in ("", "s") else "---:" for _, _, f in columns) + "|"
    body = ["| " + " | ".join(format(r[k], f) for _, k, f in columns) + " |" for r in rows]
    return "\n".join([head, rule, *body])
