"""Chapter 5's figures: the buckets against the backward (from the ledger's records of a real run),
AdamW's step on parameters and on flat buckets (its operator calls, counted), and the cost model's
answers for a GPU cluster (bucket size, tokens per GPU).

* `bucket_lanes_figure(runs, labels)`: one lane per bucket, its all-reduce from launch to the
  moment the engine saw it finished, over the compute of the same step, for several engines;
* `optimizer_calls_figure(ops, counts)`: the operator calls one AdamW step makes, per layout;
* `bucket_size_figure(psi, tokens, ns)`: exposed all-reduce time against bucket size (bucket_model);
* `tokens_to_hide_figure(psi, ...)`: the backward's time against tokens per GPU beside the
  all-reduce's, where they cross (cost_model.min_tokens_to_hide);
* `duplicated_memory_figure(reports, psi)`: each rank's measured model states beside 16 Psi.
"""

from __future__ import annotations

from ..theory import cost_model as cm
from . import bucket_model

COMPUTE_COLORS = {"forward": "#4C72B0", "backward": "#55A868", "step": "#8172B2"}
COMM_COLOR = "#DD8452"
LINE_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3"]


def bucket_lanes(row: dict) -> dict:
    """From one rank's timeline (dp_demo.timeline): ms since the step began of each compute phase,
    of each bucket's all-reduce (by bucket index, from its ledger tag 'bucket<i>'), and the wait
    after backward."""
    t0 = min(s for s, *_ in row["compute"])
    compute = {label: ((s - t0) * 1e3, (e - t0) * 1e3) for s, e, label in row["compute"]}
    buckets = {}
    for s, e, tag in row["comm"]:
        if tag.startswith("bucket"):
            buckets[int(tag[len("bucket"):])] = ((s - t0) * 1e3, (e - t0) * 1e3)
    backward_end = compute["backward"][1]
    return {"compute": compute, "buckets": dict(sorted(buckets.items())),
            "wait": (backward_end, backward_end + row["wait_after_backward_s"] * 1e3)}


def bucket_lanes_figure(runs: dict, labels: list, rank: int = 0):
    """runs: {engine name: [one timeline dict per rank]}; labels: one text per bucket.

    A panel per engine (rank `rank`): the step's forward, backward and optimizer step on the top
    lane, then one lane per bucket with its all-reduce; the backward's span is shaded across all
    lanes, and the rank's wait after its backward compute is hatched."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 0.9 + (1.0 + 0.32 * len(labels)) * len(runs)), sharex=True)
    axes = list(axes) if len(runs) > 1 else [axes]
    for ax, (name, rows) in zip(axes, runs.items()):
        lanes = bucket_lanes(rows[rank])
        b0, b1 = lanes["compute"]["backward"]
        ax.axvspan(b0, b1, color=COMPUTE_COLORS["backward"], alpha=0.12, lw=0)
        for label, (s, e) in lanes["compute"].items():
            ax.barh(0, e - s, left=s, height=0.6, color=COMPUTE_COLORS[label])
        w0, w1 = lanes["wait"]
        ax.barh(0, w1 - w0, left=w0, height=0.6, color="white", edgecolor="#C44E52", hatch="///", lw=0.8)
        for i, (s, e) in lanes["buckets"].items():
            ax.barh(1 + i, max(e - s, 0.05), left=s, height=0.6, color=COMM_COLOR, edgecolor="black", lw=0.4)
        ax.set_yticks(range(1 + len(labels)), ["compute"] + list(labels), fontsize=7.5)
        ax.invert_yaxis()
        ax.set_title(f"{name}: waited {w1 - w0:.1f} ms after the backward's compute (rank {rank})", fontsize=9)
        ax.grid(True, axis="x", alpha=0.3)
    axes[-1].set_xlabel("ms since the step began (each rank's own clock)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COMPUTE_COLORS.values()]
    handles += [plt.Rectangle((0, 0), 1, 1, color=COMM_COLOR),
                plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="#C44E52", hatch="///")]
    fig.legend(handles, ["forward", "backward (shaded across the lanes)", "optimizer step",
                         "a bucket's all-reduce, launch to seen finished", "waiting after the backward"],
               loc="lower center", ncol=3, fontsize=7.5, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def optimizer_calls_figure(ops: dict, counts: dict):
    """ops: {layout: {"calls", "scalar_reads"}} from dp_demo.aten_calls; counts: {layout: tensors}.

    One bar per layout: the calls one AdamW step makes into PyTorch's operators, the part that reads
    a number back to Python (a step count's .item()) hatched."""
    import matplotlib.pyplot as plt

    names = {"per_parameter": "one tensor at a time", "foreach": "foreach", "flat": "flat buckets"}
    fig, ax = plt.subplots(figsize=(6.5, 2.6))
    for row, (key, n) in enumerate(ops.items()):
        reads, other = n["scalar_reads"], n["calls"] - n["scalar_reads"]
        ax.barh(row, other, color=LINE_COLORS[row], label="tensor operations" if row == 0 else None)
        ax.barh(row, reads, left=other, color="white", edgecolor=LINE_COLORS[row], hatch="///",
                label="reads of one number (.item())" if row == 0 else None)
        ax.text(n["calls"] + 8, row, f"{n['calls']} calls", va="center", fontsize=8)
    ax.set_yticks(range(len(ops)), [f"{names[k]}\n({counts[k]} tensors)" for k in ops], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(n["calls"] for n in ops.values()) * 1.2)
    ax.set_xlabel("calls into PyTorch's operators (aten) in one AdamW step")
    ax.set_title("AdamW on GPT-small's parameters: each call pays a fixed cost on a CPU", fontsize=9)
    ax.legend(fontsize=7.5, loc="lower right")
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


def bucket_size_figure(psi: float, tokens_per_rank: float, ns=(8, 64, 512), cluster: cm.Cluster = cm.H100_CLUSTER,
                       default_bytes: float = 25 * 2**20):
    """Exposed all-reduce time of one DDP backward against the bucket size, one line per number of
    GPUs (bucket_model.bucket_pipeline), with PyTorch DDP's default bucket marked."""
    import matplotlib.pyplot as plt

    grad_bytes = 2 * psi
    sizes = [1e6 * 10 ** (i / 8) for i in range(60) if 1e6 * 10 ** (i / 8) < grad_bytes] + [grad_bytes]
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for color, n in zip(LINE_COLORS, ns):
        rows = bucket_model.exposed_by_bucket_size(psi, n, tokens_per_rank, sizes, cluster)
        ax.plot([s / 1e6 for s in sizes], [r["exposed_s"] * 1e3 for r in rows], "-", color=color, label=f"{n} GPUs")
        best = min(rows, key=lambda r: r["exposed_s"])
        ax.plot(best["bucket_bytes"] / 1e6, best["exposed_s"] * 1e3, "o", color=color, ms=5)
    ax.axvline(default_bytes / 1e6, color="black", ls=":", lw=1)
    ax.text(default_bytes / 1e6 * 1.1, 0.97, f"{default_bytes / 2**20:g} MiB\n(PyTorch DDP's default)", fontsize=7.5,
            va="top", transform=ax.get_xaxis_transform())
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bucket size (MB, log scale); the right end is one bucket for all the gradients")
    ax.set_ylabel("exposed all-reduce (ms)")
    ax.set_title(f"DDP's buckets on DGX H100 nodes (cost model): {psi / 1e9:g}B parameters, bf16 gradients,\n"
                 f"{tokens_per_rank:,.0f} tokens per GPU; a dot marks the least exposed time", fontsize=8.5)
    ax.legend(fontsize=8)
    ax.grid(True, which="major", alpha=0.3)
    fig.tight_layout()
    return fig


def tokens_to_hide_figure(psi: float, n: int = 64, nics=(8, 2, 1), cluster: cm.Cluster = cm.H100_CLUSTER):
    """The backward's time against tokens per GPU (a line through the origin) beside the all-reduce
    of bf16 gradients (flat: it does not depend on the tokens), on one node and on n GPUs with
    each number of network cards per node; a dot where they cross (cost_model.min_tokens_to_hide)."""
    import matplotlib.pyplot as plt

    tokens = [2 ** (7 + i / 4) for i in range(4 * 8 + 1)]          # 128 ... 32,768
    per_token = cm.BACKWARD_SHARE * cm.compute_seconds(psi, 1, cluster)
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    ax.plot(tokens, [per_token * t * 1e3 for t in tokens], "-", color="black", lw=1.6, label="backward (compute)")
    cases = [(f"all-reduce, one node ({cluster.gpus_per_node} GPUs)", cluster.gpus_per_node, cluster)]
    cases += [(f"all-reduce, {n} GPUs, {k} card{'s' if k > 1 else ''} per node", n, cm.with_nics(cluster, k))
              for k in nics]
    for i, (color, (label, gpus, c)) in enumerate(zip(LINE_COLORS, cases)):
        ar = cm.step_estimate(0, psi, gpus, 1, c).comm_s
        ax.plot(tokens, [ar * 1e3] * len(tokens), "--", color=color, label=label)
        t_hide = cm.min_tokens_to_hide(0, psi, gpus, c)
        ax.plot(t_hide, per_token * t_hide * 1e3, "o", color=color, ms=6)
        ax.annotate(f"{t_hide:,.0f}", (t_hide, per_token * t_hide * 1e3), textcoords="offset points",
                    xytext=(8, -12) if i % 2 else (-34, 6), fontsize=7.5, color=color)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = [2 ** k for k in range(7, 16, 2)]
    ax.set_xticks(ticks, [f"{t:,}" for t in ticks])
    ax.set_xlabel("tokens per GPU per step (log scale)")
    ax.set_ylabel("time (ms)")
    ax.set_title(f"When the backward hides DDP's all-reduce (cost model, {psi / 1e9:g}B parameters, bf16 gradients):\n"
                 "a dot marks the tokens per GPU where the two times meet", fontsize=8.5)
    ax.legend(fontsize=7.5, loc="upper left")
    ax.grid(True, which="major", alpha=0.3)
    fig.tight_layout()
    return fig


MEMORY_COLORS = {"params": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868"}


def duplicated_memory_figure(reports: list, psi: int, per_param=(("params", 2), ("grads", 2), ("optimizer", 12)),
                             model: str = "GPT-small"):
    """reports: each rank's memory_report() (bytes); one stacked bar per rank, and one for the paper's
    (2 + 2 + 12) psi, in MB: every rank holds a whole copy."""
    import matplotlib.pyplot as plt

    bars = [(f"rank {r}\n(measured)", rep) for r, rep in enumerate(reports)]
    bars.append(("paper\n(2 + 2 + 12) Ψ", {k: b * psi for k, b in per_param}))
    fig, ax = plt.subplots(figsize=(6.0, 3.2))
    for x, (_, parts) in enumerate(bars):
        bottom = 0.0
        for key, _ in per_param:
            h = parts[key] / 1e6
            ax.bar(x, h, bottom=bottom, width=0.55, color=MEMORY_COLORS[key], edgecolor="white",
                   label=key if x == 0 else None)
            ax.text(x, bottom + h / 2, f"{h:.1f}", ha="center", va="center", fontsize=8, color="white")
            bottom += h
    ax.set_xticks(range(len(bars)), [name for name, _ in bars], fontsize=8)
    ax.set_ylabel("model states (MB)")
    ax.set_title(f"Every rank holds a whole copy: {model} ({psi:,} parameters), bf16 AdamW", fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig
