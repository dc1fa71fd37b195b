"""The cost model beside published measurements (chapter 4 and the appendix on the cost model).

Every figure here was published by someone else, on hardware we do not have; each row says who
published it, where, and the margin within which the model is expected to reproduce it. The
model's constants come from other figures than the ones it is checked against (see the comments
in zerolab.theory.cost_model): the NVLink efficiency from one NVLink's effective rate, the network's
from one card's, the V100's compute rate from Megatron-LM's single-GPU run, the H100's MFU from
Llama 3.

    bus_rows()        nccl-tests bus bandwidths: published, the model's, relative error
    end_to_end_rows() training throughput per GPU and ZeRO++'s speed-up: published against the
                      model's two bounds (every collective hidden as far as compute allows, or
                      none hidden)
    format_rows(rows) a Markdown table
"""

from __future__ import annotations

from dataclasses import dataclass

from ..theory import cost_model as cm
from . import zeropp_demo

GB = 1e9
NCCL_TESTS_BYTES = 8e9     # nccl-tests' peak bus bandwidths are read at several GB (sizes up to 8G)


@dataclass(frozen=True)
class Check:
    """One published figure and what the model makes of it.

    low, high: the model's figure, or its two bounds (no overlap, most overlap); error: how far
    the published figure lies outside [low, high], relative to it (0 inside); margin: the stated
    tolerance, None where the model does not model the mechanism (the row says why)."""

    what: str
    published: float
    low: float
    high: float
    unit: str
    margin: float | None
    source: str
    note: str = ""

    @property
    def error(self) -> float:
        if self.published < self.low:
            return self.low / self.published - 1
        if self.published > self.high:
            return self.high / self.published - 1
        return 0.0

    @property
    def within(self) -> bool | None:
        return None if self.margin is None else abs(self.error) <= self.margin


def _busbw(cluster, n, algorithm="ring", kind="all_reduce"):
    t = cm.collective_seconds(kind, NCCL_TESTS_BYTES, n, cluster, algorithm=algorithm)
    return cm.bus_bandwidth(kind, NCCL_TESTS_BYTES, n, t) / GB


def bus_rows() -> list[Check]:
    """nccl-tests all-reduce bus bandwidths (GB/s) reported by NCCL's developers."""
    a100, h100 = cm.A100_CLUSTER, cm.H100_CLUSTER
    rows = [
        ("DGX A100, 8 GPUs (ring)", 230, _busbw(a100, 8), 0.10,
         "S. Jeaugey (NVIDIA), NVIDIA/nccl-tests issue 149, 5 July 2023: ~230 GB/s", ""),
        ("DGX H100, 8 GPUs (NCCL_ALGO=RING)", 370, _busbw(h100, 8), 0.10,
         "S. Jeaugey, NVIDIA/nccl-tests issue 212, 6 May 2024: 370 GB/s", ""),
        ("DGX A100 nodes, 8 x 200 Gb/s each (4 nodes modelled)", 192, _busbw(a100, 32), 0.10,
         "D. Addison (NVIDIA), NVIDIA/nccl issue 812, 31 March 2023: 192 GB/s", "the number of nodes is not stated; "
         "the model's figure moves by less than 1% from 2 to 8 nodes"),
        ("DGX H100, 8 GPUs, NVLink SHARP (NCCL's default)", 480, _busbw(h100, 8), None,
         "S. Jeaugey, NVIDIA/nccl-tests issue 212, 6 May 2024: ~480 GB/s",
         "not modelled: the NVSwitches add, so each GPU sends its data once, not 2(N-1)/N times"),
    ]
    return [Check(what, pub, m, m, "GB/s", margin, src, note) for what, pub, m, margin, src, note in rows]


def _throughput(collectives, psi_per_gpu, tokens, cluster):
    """(no overlap, most overlap) TFLOP/s per GPU: 6 psi tokens over the estimated step time."""
    compute = cm.compute_seconds(psi_per_gpu, tokens, cluster)
    flops = 6 * psi_per_gpu * tokens
    return tuple(flops / cm.estimate(collectives, compute, cluster, overlap).step_s / 1e12 for overlap in (False, True))


# The ZeRO paper's Table 10 (Figure 7): data parallelism only on 128 V100s, ZeRO-100B (P_os+g):
# parameters and batch per GPU. Sequences of 1,024 tokens (GPT-2's; the table does not say).
ZERO_DP_ONLY = [(1.5e9, 24), (2.5e9, 24), (4e9, 16), (6e9, 12), (8e9, 8), (10e9, 6), (11e9, 4), (12e9, 4),
                (13e9, 2)]
SEQ = 1024


def zero_dp_only_tflops(cluster=cm.V100_DGX2_CLUSTER, n=128):
    """Mean over ZERO_DP_ONLY of the (no overlap, most overlap) TFLOP/s per GPU with ZeRO-2."""
    per = [_throughput(cm.step_collectives(2, psi, n), psi, batch * SEQ, cluster) for psi, batch in ZERO_DP_ONLY]
    return tuple(sum(p[i] for p in per) / len(per) for i in (0, 1))


def zero_100b_tflops(cluster=cm.V100_DGX2_CLUSTER):
    """The ZeRO paper's 100B model on 400 V100s (Table 5): model parallelism 16 inside each DGX-2
    node, so each data-parallel group has 25 ranks, one per node, and the 16 groups of a node
    share its 8 cards. ZeRO-2 over each group on the GPU's 1/16 of the parameters; 32 sequences
    per model-parallel group. Megatron's own all-reduces inside the node are left out."""
    mp, dp, batch = 16, 25, 32
    psi = 100e9 / mp
    collectives = [cm.Collective(c.kind, c.nbytes, dp, c.phase, ranks_per_node=1)
                   for c in cm.step_collectives(2, psi, dp)]
    return _throughput(collectives, psi, batch * SEQ, cluster)


def zeropp_tflops(option, nics, psi=138e9, tokens=1024, n=384):
    """ZeRO-3 or ZeRO++ ('qwZ+hpZ+qgZ') on the ZeRO++ evaluation's 384 V100s (24 DGX-2 nodes) with
    `nics` 100 Gb/s cards per node, fp16, `tokens` per GPU: (no overlap, most overlap)."""
    cluster = cm.with_nics(cm.V100_DGX2_CLUSTER, nics)
    collectives = zeropp_demo.option_collectives(option, psi, n, cluster.gpus_per_node, b=2)
    return _throughput(collectives, psi, tokens, cluster)


def end_to_end_rows() -> list[Check]:
    """Published training throughput against the model's two bounds."""
    rows = [Check("ZeRO, data parallel only, 1.5B-13B on 128 V100s (mean)", 40, *zero_dp_only_tflops(),
                  "TFLOP/s per GPU", 0.15,
                  "Rajbhandari et al., ZeRO (SC 2020), section 10.4: \"over 40 TFlops per GPU on average\"",
                  "the published figure is a lower bound"),
            Check("ZeRO-100B, 100B on 400 V100s (model parallel 16 x data parallel 25)", 38, *zero_100b_tflops(),
                  "TFLOP/s per GPU", 0.15, "Rajbhandari et al., ZeRO (SC 2020), section 1: \"38 TFlops per GPU\"",
                  "model parallelism's all-reduces inside the node are left out")]
    for nics in (4, 1):
        for option, label in (("ZeRO-3", "ZeRO-3"), ("qwZ+hpZ+qgZ", "ZeRO++")):
            pub = {(4, "ZeRO-3"): 23, (4, "ZeRO++"): 36, (1, "ZeRO-3"): 11, (1, "ZeRO++"): 22}[nics, label]
            rows.append(Check(f"{label}, 138B on 384 V100s, {nics} x 100 Gb/s per node, 1K tokens per GPU", pub,
                              *zeropp_tflops(option, nics), "TFLOP/s per GPU", 0.15,
                              f"DeepSpeed team, ZeRO++ blog (2023), Figure {6 if nics == 4 else 7}: {pub}"))
    return rows


def speedup_rows() -> list[Check]:
    """ZeRO++'s speed-up over ZeRO-3: the ratio of the bounds above, no overlap on both sides
    (the larger) or most overlap on both (the smaller)."""
    out = []
    for nics, pub in ((4, 36 / 23), (1, 22 / 11)):
        z3, pp = zeropp_tflops("ZeRO-3", nics), zeropp_tflops("qwZ+hpZ+qgZ", nics)
        ratios = sorted((pp[0] / z3[0], pp[1] / z3[1]))
        out.append(Check(f"ZeRO++ over ZeRO-3, 138B, {nics} x 100 Gb/s per node", pub, *ratios, "x", 0.15,
                         f"DeepSpeed team, ZeRO++ blog (2023), Figure {6 if nics == 4 else 7}"))
    return out


def all_rows() -> list[Check]:
    return bus_rows() + end_to_end_rows() + speedup_rows()


def _num(v: float, unit: str) -> str:
    return f"{v:.2f}" if unit == "x" else f"{v:.0f}" if v >= 10 else f"{v:.1f}"


def format_rows(rows) -> str:
    lines = ["| published figure | published | model | outside by | margin | source |",
             "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        model = (_num(r.low, r.unit) if abs(r.high - r.low) < 1e-9 * r.high
                 else f"{_num(r.low, r.unit)} to {_num(r.high, r.unit)}")
        margin = "not modelled" if r.margin is None else f"±{r.margin:.0%}"
        note = f" ({r.note})" if r.note else ""
        lines.append(f"| {r.what}{note} | {_num(r.published, r.unit)} {r.unit} | {model} | {100 * r.error:+.0f}% | "
                     f"{margin} | {r.source} |")
    return "\n".join(lines)
