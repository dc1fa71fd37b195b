"""The cost model beside published measurements (chapter 4 and the appendix on the cost model).

Every figure here was published by someone else, on hardware the book does not have. Each row is
ONE prediction of the model (zerolab.theory.cost_model as the chapters use it) beside the published
figure, and a verdict against a margin fixed for its kind of figure before the comparison
(MARGINS): a hit, a miss (with the model's reason), a row that only restates the figure a constant
was set from, or a mechanism the model does not have.

    bus_rows()          nccl-tests bus bandwidths
    end_to_end_rows()   training throughput per GPU: the ZeRO paper, and every bar of the ZeRO++
                        blog's Figures 6 and 7 (both panels, every model size)
    speedup_rows()      ZeRO++ over ZeRO-3, from the same bars
    format_rows(rows), format_zeropp(rows), format_misses(rows), tally(rows): Markdown for the page
"""

from __future__ import annotations

from dataclasses import dataclass

from ..theory import cost_model as cm
from . import zeropp_demo

GB = 1e9
NCCL_TESTS_BYTES = 8e9     # nccl-tests' peak bus bandwidths are read at several GB (sizes up to 8G)
# Margins, one per kind of figure, fixed before any row below was compared with the model (the page
# has used them since its first version): a bandwidth is link rate x efficiency, both quoted to a few
# percent; a throughput or a speed-up adds the compute rate and the overlap, each uncertain by more.
MARGINS = {"bandwidth": 0.10, "throughput": 0.15, "speed-up": 0.15}
# How the model is asked: the same rule for every throughput row, the one every chapter uses.
OVERLAP = "each pass hides what it can"      # forward collectives behind a third of the compute,
#                                              backward ones behind two thirds, none after the step
ROLES = ("check", "calibration", "not modelled")


@dataclass(frozen=True)
class Check:
    """One published figure and the model's one prediction of it.

    kind: "bandwidth", "throughput" or "speed-up" (sets the margin); role: "check" (independent of
    the constants), "calibration" (restates a figure a constant was set from: shown, not counted) or
    "not modelled" (a mechanism the model lacks; the test checks the direction of the miss).
    nothing_hidden: the throughput with no overlap at all, and ceiling: the model's compute rate,
    both only to explain a miss; sides: for a speed-up, its two throughput rows."""

    what: str
    published: float
    predicted: float
    unit: str
    kind: str
    source: str
    role: str = "check"
    assumption: str = ""
    note: str = ""
    nothing_hidden: float | None = None
    ceiling: float | None = None
    sides: tuple = ()

    @property
    def margin(self) -> float:
        return MARGINS[self.kind]

    @property
    def error(self) -> float:
        """The prediction relative to the published figure: predicted / published - 1."""
        return self.predicted / self.published - 1

    @property
    def hit(self) -> bool | None:
        """Within the margin (None for a row that is not a check)."""
        return abs(self.error) <= self.margin if self.role == "check" else None

    @property
    def verdict(self) -> str:
        if self.role != "check":
            return {"calibration": "restates a calibration", "not modelled": "not modelled"}[self.role]
        return "hit" if self.hit else "miss"

    @property
    def reason(self) -> str:
        """Why the model misses this row ('' for a hit or a row that is not a check)."""
        if self.hit is not False:
            return ""
        if self.kind == "speed-up":
            return "; ".join(f"{s.what.split(',')[0]} {100 * s.error:+.0f}%: {s.reason or 'within its margin'}"
                             for s in self.sides)
        return _reason(self)

    @property
    def cause(self) -> str:
        """The reason in a few words, the same for every row it applies to (to group the misses)."""
        if self.hit is not False:
            return ""
        if self.kind == "speed-up":
            missed = [s for s in self.sides if s.hit is False]
            return (" and ".join(f"{s.what.split(',')[0]} {s.cause}" for s in missed) if missed
                    else "each side within its margin, the two errors add up")
        return self.reason.split(" (")[0].split(":")[0]


def _reason(r: Check) -> str:
    u = r.unit.split()[0]
    if r.kind == "throughput" and r.published > r.predicted:
        if r.ceiling is not None and r.predicted >= 0.995 * r.ceiling:
            return (f"computed faster than the model's compute rate ({r.ceiling:.0f} {u}, Megatron-LM's "
                    "single-V100 figure of 2019)")
        return "ran faster than the model allows on this network: its links or its overlap are too pessimistic"
    if r.kind == "throughput":
        if r.nothing_hidden is not None and r.published >= r.nothing_hidden:
            return (f"hid less of its communication than the model assumes (with nothing hidden the model gives "
                    f"{r.nothing_hidden:.1f} {u})")
        return "slower than the model with nothing hidden: costs the model leaves out"
    return "the links deliver more than the model's efficiency" if r.published > r.predicted else \
        "the links deliver less than the model's efficiency"


# ------------------------------------------------------------------ bus bandwidths
def _busbw(cluster, n, algorithm="ring", kind="all_reduce"):
    t = cm.collective_seconds(kind, NCCL_TESTS_BYTES, n, cluster, algorithm=algorithm)
    return cm.bus_bandwidth(kind, NCCL_TESTS_BYTES, n, t) / GB


def bus_rows() -> list[Check]:
    """nccl-tests all-reduce bus bandwidths (GB/s) reported by NCCL's developers, ring algorithm, 8 GB."""
    a100, h100 = cm.A100_CLUSTER, cm.H100_CLUSTER
    ring = "one ring all-reduce of 8 GB"
    return [
        Check("DGX A100, 8 GPUs (ring)", 230, _busbw(a100, 8), "GB/s", "bandwidth",
              "S. Jeaugey (NVIDIA), NVIDIA/nccl-tests issue 149, 5 July 2023: ~230 GB/s", "calibration", ring,
              "the same thread's 20 of 25 GB/s per NVLink set the NVLink efficiency"),
        Check("DGX H100, 8 GPUs (NCCL_ALGO=RING)", 370, _busbw(h100, 8), "GB/s", "bandwidth",
              "S. Jeaugey, NVIDIA/nccl-tests issue 212, 6 May 2024: 370 GB/s", "calibration", ring,
              "its ~20% protocol overhead is the NVLink efficiency again"),
        Check("DGX A100 nodes, 8 x 200 Gb/s cards each (4 nodes modelled)", 192, _busbw(a100, 32), "GB/s",
              "bandwidth", "D. Addison (NVIDIA), NVIDIA/nccl issue 812, 31 March 2023: 192 GB/s", "check", ring,
              "the number of nodes is not stated; the model moves by less than 1% from 2 to 8 nodes"),
        Check("2 DGX H100 nodes, 8 x 400 Gb/s cards each (ring)", 396, _busbw(h100, 16), "GB/s", "bandwidth",
              "D. Addison (NVIDIA), NVIDIA/nccl-tests issue 319, 11 June 2025: \"up to ~396GB/s with the RING "
              "protocol\"", "check", ring,
              "an NVIDIA engineer's expected figure, not a measurement; its per-card rate (~48 GB/s) is of the kind "
              "that set the network efficiency, the spread over the node's 8 cards is what it checks"),
        Check("DGX H100, 8 GPUs, NVLink SHARP (NCCL's default)", 480, _busbw(h100, 8), "GB/s", "bandwidth",
              "S. Jeaugey, NVIDIA/nccl-tests issue 212, 6 May 2024: ~480 GB/s", "not modelled", ring,
              "the NVSwitches add, so each GPU sends its data once, not 2(N-1)/N times"),
    ]


# ------------------------------------------------------------------ training throughput
def _throughput(collectives, psi_per_gpu, tokens, cluster, overlap=True):
    """TFLOP/s per GPU: 6 psi tokens over the estimated step time."""
    compute = cm.compute_seconds(psi_per_gpu, tokens, cluster)
    return 6 * psi_per_gpu * tokens / cm.estimate(collectives, compute, cluster, overlap).step_s / 1e12


# The ZeRO paper's Table 10 (Figure 7): data parallelism only on 128 V100s, ZeRO-100B (P_os+g):
# parameters and batch per GPU. Sequences of 1,024 tokens (GPT-2's; the table does not say).
ZERO_DP_ONLY = [(1.5e9, 24), (2.5e9, 24), (4e9, 16), (6e9, 12), (8e9, 8), (10e9, 6), (11e9, 4), (12e9, 4),
                (13e9, 2)]
SEQ = 1024


def zero_dp_only_tflops(cluster=cm.V100_DGX2_CLUSTER, n=128, overlap=True):
    """Mean over ZERO_DP_ONLY of the TFLOP/s per GPU with ZeRO-2."""
    per = [_throughput(cm.step_collectives(2, psi, n), psi, batch * SEQ, cluster, overlap) for psi, batch in ZERO_DP_ONLY]
    return sum(per) / len(per)


def zero_100b_tflops(cluster=cm.V100_DGX2_CLUSTER, overlap=True):
    """The ZeRO paper's 100B model on 400 V100s (Table 5): model parallelism 16 inside each DGX-2
    node, so each data-parallel group has 25 ranks, one per node, and the 16 groups of a node
    share its 8 cards. ZeRO-2 over each group on the GPU's 1/16 of the parameters; 32 sequences
    per model-parallel group. Megatron's own all-reduces inside the node are left out."""
    mp, dp, batch = 16, 25, 32
    psi = 100e9 / mp
    collectives = [cm.Collective(c.kind, c.nbytes, dp, c.phase, ranks_per_node=1)
                   for c in cm.step_collectives(2, psi, dp)]
    return _throughput(collectives, psi, batch * SEQ, cluster, overlap)


def zeropp_tflops(option, nics, psi=138e9, tokens=1024, n=384, overlap=True):
    """ZeRO-3 or ZeRO++ ('qwZ+hpZ+qgZ') on the ZeRO++ evaluation's 384 V100s (24 DGX-2 nodes) with
    `nics` 100 Gb/s cards per node, fp16, `tokens` per GPU."""
    cluster = cm.with_nics(cm.V100_DGX2_CLUSTER, nics)
    collectives = zeropp_demo.option_collectives(option, psi, n, cluster.gpus_per_node, b=2)
    return _throughput(collectives, psi, tokens, cluster, overlap)


# The ZeRO++ blog's Figures 6 (4 cards per node) and 7 (1 card): TFLOP/s per GPU as the bars are
# labelled, (ZeRO-3, ZeRO++), for each model size and both panels (1K and 2K tokens per GPU); and
# the speed-ups its arrows print, where they print one (elsewhere the ratio of the labels).
ZEROPP_SIZES = (18, 49, 91, 138)
ZEROPP_BARS = {(4, 1024): ((25, 35), (23, 36), (23, 36), (23, 36)),
               (4, 2048): ((40, 53), (36, 51), (36, 51), (36, 50)),
               (1, 1024): ((14, 31), (11, 22), (11, 22), (11, 22)),
               (1, 2048): ((26, 46), (20, 38), (20, 38), (20, 38))}
ZEROPP_ARROWS = {(4, 1024, 138): 1.56, (4, 2048, 49): 1.41, (1, 1024, 18): 2.21, (1, 2048, 18): 1.77}
ZEROPP_TEXT = {(4, 1024): "28% to 36%", (4, 2048): "24% to 29%"}     # the blog's prose for Figure 6


def _figure(nics):
    return 6 if nics == 4 else 7


def _zeropp_row(label, option, nics, tokens, size, published):
    v100 = cm.V100_DGX2_CLUSTER
    fig = _figure(nics)
    return Check(f"{label}, {size}B, {nics} x 100 Gb/s per node, {tokens // 1024}K tokens per GPU", published,
                 zeropp_tflops(option, nics, size * 1e9, tokens), "TFLOP/s per GPU", "throughput",
                 f"DeepSpeed team, ZeRO++ blog (2023), Figure {fig}, {tokens // 1024}K panel", "check", OVERLAP,
                 nothing_hidden=zeropp_tflops(option, nics, size * 1e9, tokens, overlap=False),
                 ceiling=v100.achieved_flops / 1e12)


def end_to_end_rows() -> list[Check]:
    """Published training throughput against the model's one prediction."""
    v100 = cm.V100_DGX2_CLUSTER.achieved_flops / 1e12
    rows = [Check("ZeRO, data parallel only, 1.5B-13B on 128 V100s (mean)", 40, zero_dp_only_tflops(),
                  "TFLOP/s per GPU", "throughput",
                  "Rajbhandari et al., ZeRO (SC 2020), section 10.4: \"over 40 TFlops per GPU on average\"",
                  "check", OVERLAP, "the published figure is a lower bound; the per-size bars of its Figure 4 are "
                  "not transcribed here", zero_dp_only_tflops(overlap=False), v100),
            Check("ZeRO-100B, 100B on 400 V100s (model parallel 16 x data parallel 25)", 38, zero_100b_tflops(),
                  "TFLOP/s per GPU", "throughput",
                  "Rajbhandari et al., ZeRO (SC 2020), section 1: \"38 TFlops per GPU\"", "check", OVERLAP,
                  "model parallelism's all-reduces inside the node are left out", zero_100b_tflops(overlap=False),
                  v100)]
    for (nics, tokens), bars in ZEROPP_BARS.items():
        for size, (z3, pp) in zip(ZEROPP_SIZES, bars):
            rows.append(_zeropp_row("ZeRO-3", "ZeRO-3", nics, tokens, size, z3))
            rows.append(_zeropp_row("ZeRO++", "qwZ+hpZ+qgZ", nics, tokens, size, pp))
    return rows


def speedup_rows(throughput=None) -> list[Check]:
    """ZeRO++ over ZeRO-3 for every bar pair: the ratio of the two point predictions."""
    rows = [r for r in (throughput or end_to_end_rows()) if r.what.startswith(("ZeRO-3,", "ZeRO++,"))]
    out = []
    for z3, pp in zip(rows[0::2], rows[1::2]):
        _, size, nics, tokens = (z3.what.split(", ")[i] for i in range(4))
        key = (int(nics.split()[0]), int(tokens.split("K")[0]) * 1024, int(size[:-1]))
        published = ZEROPP_ARROWS.get(key, pp.published / z3.published)
        how = "its arrow" if key in ZEROPP_ARROWS else "the ratio of its bar labels"
        out.append(Check(f"ZeRO++ over ZeRO-3, {size}, {nics}, {tokens}", published, pp.predicted / z3.predicted,
                         "x", "speed-up", f"DeepSpeed team, ZeRO++ blog (2023), Figure {_figure(key[0])}, {how}",
                         "check", OVERLAP, sides=(z3, pp)))
    return out


def all_rows() -> list[Check]:
    e2e = end_to_end_rows()
    return bus_rows() + e2e + speedup_rows(e2e)


def tally(rows) -> dict:
    """How many rows of each verdict."""
    out = dict.fromkeys(("hit", "miss", "restates a calibration", "not modelled"), 0)
    for r in rows:
        out[r.verdict] += 1
    return out


# ------------------------------------------------------------------ Markdown
def _num(v: float, unit: str) -> str:
    return f"{v:.2f}" if unit == "x" else f"{v:.0f}" if v >= 10 else f"{v:.1f}"


def format_rows(rows) -> str:
    """One line per row: published, the model's prediction, their difference, the verdict."""
    lines = ["| published figure | published | model | model / published - 1 | verdict | source |",
             "|---|---:|---:|---:|---|---|"]
    for r in rows:
        note = f" ({r.note})" if r.note else ""
        lines.append(f"| {r.what}{note} | {_num(r.published, r.unit)} {r.unit} | {_num(r.predicted, r.unit)} | "
                     f"{100 * r.error:+.0f}% | {r.verdict} | {r.source} |")
    return "\n".join(lines)


def format_zeropp(rows) -> str:
    """The ZeRO++ figures' bars and speed-ups, one line per bar pair: published / model, hit or miss."""
    by = {r.what: r for r in rows}
    mark = {True: "hit", False: "**miss**"}
    lines = ["| figure | cards per node | tokens per GPU | model | ZeRO-3 (TFLOP/s) | ZeRO++ (TFLOP/s) | speed-up |",
             "|---|---:|---:|---:|---|---|---|"]
    for (nics, tokens) in ZEROPP_BARS:
        for size in ZEROPP_SIZES:
            tail = f"{size}B, {nics} x 100 Gb/s per node, {tokens // 1024}K tokens per GPU"
            cells = []
            for r in (by[f"ZeRO-3, {tail}"], by[f"ZeRO++, {tail}"],
                      by[f"ZeRO++ over ZeRO-3, {size}B, {nics} x 100 Gb/s per node, {tokens // 1024}K tokens per GPU"]):
                cells.append(f"{_num(r.published, r.unit)} / {_num(r.predicted, r.unit)} ({100 * r.error:+.0f}%, "
                             f"{mark[r.hit]})")
            lines.append(f"| {_figure(nics)} | {nics} | {tokens:,} | {size}B | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_misses(rows) -> str:
    """The misses grouped by the model's reason, with how many rows share it."""
    groups: dict = {}
    for r in rows:
        if r.hit is False:
            groups.setdefault((r.kind, r.cause), []).append(r)
    lines = ["| kind | rows | why the model misses |", "|---|---:|---|"]
    for (kind, cause), rs in groups.items():
        lines.append(f"| {kind} | {len(rs)} | {cause} |")
    return "\n".join(lines)
