"""The cost model against hand-worked closed forms, nccl-tests' definitions and the ledger's bytes."""

import math

import pytest
import torch
import torch.distributed as dist

import zerolab as zl
from zerolab import cost_model as cm
from zerolab.comm import Ledger

LINK = cm.Link("test link", alpha_s=3e-6, bandwidth_Bps=450e9)


# ------------------------------------------------------------------ the preset: stated assumptions
def test_h100_cluster_is_the_stated_hardware():
    c = cm.H100_CLUSTER
    assert c.gpus_per_node == 8
    assert c.intra.bandwidth_Bps == 900e9 / 2          # NVLink 4: 900 GB/s both ways together
    assert c.inter.bandwidth_Bps == 400e9 / 8          # one 400 Gb/s NIC per GPU, in bytes
    assert c.peak_flops == 989e12 and c.mfu == 0.4
    assert c.achieved_flops == pytest.approx(395.6e12)
    assert 1e-6 <= c.intra.alpha_s < c.inter.alpha_s <= 20e-6   # "a few microseconds"


# ------------------------------------------------------------------ collectives, worked by hand
def test_all_reduce_of_one_gigabyte_on_eight_ranks():
    # 2(N-1) = 14 steps of 3 us; each rank sends 2 * 7/8 * 1 GB = 1.75 GB at 450 GB/s
    expected = 14 * 3e-6 + 1.75e9 / 450e9
    assert cm.collective_seconds("all_reduce", 1e9, 8, LINK) == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(3.930889e-3, rel=1e-6)


@pytest.mark.parametrize("kind", ["reduce_scatter", "all_gather"])
def test_half_collectives_on_four_ranks(kind):
    # N-1 = 3 steps; each rank sends 3/4 of 64 MB = 48 MB
    expected = 3 * 3e-6 + 48e6 / 450e9
    assert cm.collective_seconds(kind, 64e6, 4, LINK) == pytest.approx(expected, rel=1e-12)


def test_all_reduce_is_reduce_scatter_then_all_gather():
    for n in (2, 3, 8, 64):
        rs = cm.collective_seconds("reduce_scatter", 1e8, n, LINK)
        ag = cm.collective_seconds("all_gather", 1e8, n, LINK)
        assert cm.collective_seconds("all_reduce", 1e8, n, LINK) == pytest.approx(rs + ag, rel=1e-12)


def test_small_messages_cost_latency_large_ones_bandwidth():
    # 8 bytes on 8 ranks: the 14 latencies are the whole cost; 10 GB: the bandwidth is
    assert cm.collective_seconds("all_reduce", 8, 8, LINK) == pytest.approx(14 * 3e-6, rel=1e-6)
    big = cm.collective_seconds("all_reduce", 1e10, 8, LINK)
    assert big == pytest.approx(2 * 7 / 8 * 1e10 / 450e9, rel=2e-3)   # latency: 0.1%


def test_one_rank_moves_nothing_and_bad_input_is_refused():
    assert cm.collective_seconds("all_reduce", 1e9, 1, LINK) == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        cm.collective_seconds("allreduce", 1e9, 8, LINK)
    with pytest.raises(ValueError, match="at least 1"):
        cm.collective_seconds("all_reduce", 1e9, 0, LINK)


# ------------------------------------------------------------------ nccl-tests' bandwidths
def test_algorithm_and_bus_bandwidth_definitions():
    # doc/PERFORMANCE.md: algbw = S/t; busbw = algbw * 2(n-1)/n (all-reduce), * (n-1)/n (RS, AG)
    assert cm.algorithm_bandwidth(1e9, 0.01) == pytest.approx(100e9)
    assert cm.bus_bandwidth("all_reduce", 1e9, 8, 0.01) == pytest.approx(100e9 * 14 / 8)
    assert cm.bus_bandwidth("reduce_scatter", 1e9, 8, 0.01) == pytest.approx(100e9 * 7 / 8)
    assert cm.bus_bandwidth("all_gather", 1e9, 4, 0.01) == pytest.approx(100e9 * 3 / 4)


@pytest.mark.parametrize("kind", cm.KINDS)
@pytest.mark.parametrize("n", [2, 3, 8, 16, 512])
def test_bus_bandwidth_of_a_latency_free_ring_is_the_link_bandwidth(kind, n):
    # the reason busbw exists: it equals the link's bandwidth whatever N, for an ideal ring
    link = cm.Link("ideal", alpha_s=0.0, bandwidth_Bps=50e9)
    t = cm.collective_seconds(kind, 3e9, n, link)
    assert cm.bus_bandwidth(kind, 3e9, n, t) == pytest.approx(50e9, rel=1e-12)
    # while the algorithm bandwidth falls as N grows (towards B/2 for all-reduce, B otherwise)
    limit = 25e9 if kind == "all_reduce" else 50e9
    assert cm.algorithm_bandwidth(3e9, t) == pytest.approx(limit * n / (n - 1), rel=1e-12)


def test_bottleneck_link():
    c = cm.H100_CLUSTER
    assert cm.bottleneck_link(2, c) is c.intra
    assert cm.bottleneck_link(8, c) is c.intra
    assert cm.bottleneck_link(9, c) is c.inter
    assert cm.bottleneck_link(1024, c) is c.inter


# ------------------------------------------------------------------ a training step, worked by hand
def test_ddp_step_on_one_node_by_hand():
    psi, n, tokens = 1e9, 8, 16 * 1024
    compute = 6 * 1e9 * 16384 / (989e12 * 0.4)                    # 0.2485 s
    comm = 14 * 3e-6 + 2 * 7 / 8 * 2e9 / 450e9                    # bf16 gradients: 2 GB
    est = cm.step_estimate(0, psi, n, tokens, cm.H100_CLUSTER)
    assert est.compute_s == pytest.approx(compute, rel=1e-12)
    assert est.comm_s == pytest.approx(comm, rel=1e-12)
    assert comm < 2 / 3 * compute and est.exposed_s == 0.0        # backward hides it
    assert est.step_s == pytest.approx(compute) and est.hidden_fraction == 1.0


def test_ddp_step_across_nodes_by_hand():
    # 7B parameters on 64 GPUs, 2,048 tokens per rank: the network cannot keep up
    psi, n, tokens = 7e9, 64, 2048
    compute = 6 * 7e9 * 2048 / (989e12 * 0.4)
    comm = 2 * 63 * 10e-6 + 2 * 63 / 64 * 14e9 / 50e9
    est = cm.step_estimate(0, psi, n, tokens, cm.H100_CLUSTER)
    assert est.comm_s == pytest.approx(comm, rel=1e-12)
    assert est.exposed_s == pytest.approx(comm - 2 / 3 * compute, rel=1e-12)
    assert est.exposed_s > 0


def test_zero_stages_volumes_and_overlap():
    ideal = cm.Cluster("ideal", 8, cm.Link("a", 0.0, 450e9), cm.Link("b", 0.0, 50e9), 1e15, 0.5)
    ddp, z1, z2, z3 = (cm.step_estimate(s, 1e9, 16, 4096, ideal) for s in (0, 1, 2, 3))
    # the paper's volumes: 2 Psi for stages 0-2, 3 Psi for stage 3 (latency-free links)
    assert z1.comm_s == pytest.approx(ddp.comm_s, rel=1e-12) == z2.comm_s
    assert z3.comm_s == pytest.approx(1.5 * ddp.comm_s, rel=1e-12)
    # ZeRO-1/2: the all-gather after the step is exposed whole, even when backward hides the rest
    huge = cm.step_estimate(1, 1e9, 16, 10**9, ideal)
    assert huge.exposed_s == pytest.approx(cm.collective_seconds("all_gather", 2e9, 16, ideal.inter))
    assert cm.step_estimate(0, 1e9, 16, 10**9, ideal).exposed_s == 0.0


def test_zero3_exposed_by_hand():
    ideal = cm.Cluster("ideal", 8, cm.Link("a", 0.0, 450e9), cm.Link("b", 0.0, 50e9), 1e15, 0.5)
    psi, n, tokens = 1e9, 16, 1024
    compute = 6 * 1e9 * 1024 / 5e14                     # 12.3 ms
    gather = 15 / 16 * 2e9 / 50e9                        # 37.5 ms per collective
    # forward: one all-gather beside a third of compute; backward: two beside two thirds
    exposed = (gather - compute / 3) + (2 * gather - 2 * compute / 3)
    est = cm.step_estimate(3, psi, n, tokens, ideal)
    assert est.comm_s == pytest.approx(3 * gather, rel=1e-12)
    assert est.exposed_s == pytest.approx(exposed, rel=1e-12)


def test_min_tokens_to_hide_is_the_break_even():
    c = cm.H100_CLUSTER
    for stage, n in [(0, 8), (0, 64), (3, 64)]:
        t = cm.min_tokens_to_hide(stage, 7e9, n, c)
        assert cm.step_estimate(stage, 7e9, n, t * 1.01, c).exposed_s == 0.0
        assert cm.step_estimate(stage, 7e9, n, t * 0.99, c).exposed_s > 0.0
    # by hand for DDP on 64 GPUs: all-reduce time = 2/3 * 6 * psi * T / achieved
    ar = 2 * 63 * 10e-6 + 2 * 63 / 64 * 14e9 / 50e9
    assert cm.min_tokens_to_hide(0, 7e9, 64, c) == pytest.approx(ar / (2 / 3 * 6 * 7e9 / 395.6e12))


def test_bad_stage_is_refused():
    with pytest.raises(ValueError, match="stage"):
        cm.step_estimate(4, 1e9, 8, 1024, cm.H100_CLUSTER)


# ------------------------------------------------------------------ the model's bytes = the ledger's
def ledger_bytes_worker(sizes, numel):
    """On subgroups of each size, run each collective through zerolab's ledger; return its bytes."""
    out = {}
    for n in sizes:
        group = dist.new_group(list(range(n)))      # every rank must create every group
        if dist.get_rank() >= n:
            continue
        led = Ledger(group=group)
        for dtype in (torch.float32, torch.float16):
            full = torch.ones(numel, dtype=dtype)
            led.all_reduce(full.clone())
            led.reduce_scatter(torch.empty(numel // n, dtype=dtype), full.clone())
            led.all_gather(torch.empty(numel, dtype=dtype), full[: numel // n].clone())
        out[n] = [(r.op, r.dtype, r.numel, r.bytes_sent, r.group_size) for r in led.records]
    return out


def test_wire_bytes_equal_the_ledgers_ring_bytes():
    numel = 2 * 3 * 4 * 101                       # divisible by every group size below
    results = zl.launch(ledger_bytes_worker, 4, args=((2, 3, 4), numel), timeout=120)
    checked = 0
    for rank, out in enumerate(results):
        for n, records in out.items():
            assert rank < n
            for op, dtype, elements, sent, group_size in records:
                assert group_size == n and elements == numel
                nbytes = numel * getattr(torch, dtype).itemsize
                assert sent == round(cm.wire_bytes(op, nbytes, n)), (op, dtype, n)
                # the ledger's bytes over a latency-free link's time: the link's bandwidth
                t = cm.collective_seconds(op, nbytes, n, cm.Link("ideal", 0.0, 1e9))
                assert math.isclose(sent / t, 1e9, rel_tol=1e-9)
                assert math.isclose(cm.bus_bandwidth(op, nbytes, n, t), sent / t, rel_tol=1e-9)
                checked += 1
    assert checked == (2 + 3 + 4) * 6
