"""The data behind chapters 4 and 5's and the appendix's figures, checked against closed forms.

* collective_plots.senders: the links each collective uses, and the bytes the ledger books on them
  (the ring's (N-1)/N and 2(N-1)/N of S; a broadcast chain's S per rank but the last);
* bucket_model.bucket_pipeline: DDP's buckets on the cost model, against the schedule worked by hand
  (one bucket: the whole all-reduce is exposed; buckets faster than the backward: only the last one;
  buckets slower: the queue);
* ddp_plots.bucket_lanes: a timeline turned into lanes (ms since the step began);
* dp_demo.aten_calls: AdamW one tensor at a time makes the same calls for every tensor;
* every figure builds, with a title and labelled axes.
"""

import matplotlib
import pytest

matplotlib.use("Agg")

from zerolab.book import bucket_model, collective_plots, cost_check_plots, cost_checks, ddp_plots  # noqa: E402
from zerolab.theory import cost_model as cm  # noqa: E402

H = cm.H100_CLUSTER


# ------------------------------------------------------------------ chapter 4
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_senders_are_the_links_the_ledger_books(n):
    assert collective_plots.senders("reduce", n) == [(r, 0) for r in range(1, n)]
    assert collective_plots.senders("broadcast", n) == [(r, r + 1) for r in range(n - 1)]
    for op in ("all_reduce", "reduce_scatter", "all_gather"):
        links = collective_plots.senders(op, n)
        assert sorted(a for a, _ in links) == list(range(n))          # every rank sends once...
        assert sorted(b for _, b in links) == list(range(n))          # ...and receives once: a ring
        assert all(b == (a + 1) % n for a, b in links)
    with pytest.raises(ValueError, match="unknown collective"):
        collective_plots.senders("all_to_all", n)


def test_ring_factor_is_the_formula():
    for n in (2, 3, 4, 64):
        assert collective_plots.ring_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
        assert collective_plots.ring_factor("all_gather", n) == pytest.approx((n - 1) / n)


@pytest.mark.slow
def test_who_holds_what_books_the_ring_and_chain_bytes():
    import zerolab as zl
    from zerolab.book import dp_demo

    n, elem = 4, 4
    res = zl.launch(dp_demo.who_holds_what, world_size=n, args=(True,))
    sent = [r[1] for r in res]
    s = n * elem                                   # each rank's tensor: n fp32 numbers
    for r in range(n):
        assert sent[r]["all_reduce"] == 2 * (n - 1) * s // n
        assert sent[r]["reduce_scatter"] == sent[r]["all_gather"] == (n - 1) * s // n
        assert sent[r]["broadcast"] == (s if r < n - 1 else 0)        # a chain from rank 0
        assert sent[r]["reduce"] == (s if r != 0 else 0)               # measured: naive_reduce's isends
    assert res[0][0] == zl.launch(dp_demo.who_holds_what, world_size=n)[0]   # the holdings are unchanged


def test_chapter_4_figures_build():
    sent = [{op: 12 for op in collective_plots.OPS} for _ in range(4)]
    fig = collective_plots.movement_figure(sent)
    assert len(fig.axes) == len(collective_plots.OPS) and fig._suptitle.get_text()
    rows = [(n, op, collective_plots.ring_factor(op, n) * 4800, 0) for n in (2, 3, 4)
            for op in ("reduce_scatter", "all_gather", "all_reduce")]
    ax = collective_plots.bytes_vs_ranks_figure(rows, 4800).axes[0]
    assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title()


# ------------------------------------------------------------------ chapter 5: the bucket model
def test_bucket_sizes_cover_the_gradients():
    assert bucket_model.bucket_sizes(100, 30) == [30, 30, 30, 10]
    assert bucket_model.bucket_sizes(100, 100) == [100]
    assert bucket_model.bucket_sizes(100, 500) == [100]
    with pytest.raises(ValueError):
        bucket_model.bucket_sizes(100, 0)


def test_one_bucket_exposes_the_whole_all_reduce():
    psi, n, tokens = 1.5e9, 64, 1024
    one = bucket_model.bucket_pipeline(psi, n, tokens, 2 * psi, H)
    assert one["buckets"] == 1
    assert one["exposed_s"] == pytest.approx(cm.collective_seconds("all_reduce", 2 * psi, n, H), rel=1e-12)
    assert one["backward_s"] == pytest.approx(cm.BACKWARD_SHARE * cm.compute_seconds(psi, tokens, H))


def test_buckets_faster_than_the_backward_expose_only_the_last():
    psi, n, k = 1.5e9, 8, 10
    bucket = 2 * psi / k
    c = cm.collective_seconds("all_reduce", bucket, n, H)
    tokens = 4 * 8192                                  # a long backward: each bucket is done before the next
    r = bucket_model.bucket_pipeline(psi, n, tokens, bucket, H)
    assert r["backward_s"] / k > c
    assert r["buckets"] == k and r["comm_s"] == pytest.approx(k * c)
    assert r["exposed_s"] == pytest.approx(c, rel=1e-9)


def test_buckets_slower_than_the_backward_queue_up():
    psi, n, k = 1.5e9, 512, 100
    bucket = 2 * psi / k
    cost = cm.collective_cost("all_reduce", bucket, n, H)
    r = bucket_model.bucket_pipeline(psi, n, 16, bucket, H)    # a short backward: the all-reduces queue
    assert r["backward_s"] / k < cost.seconds
    # the first starts when its bucket is ready; the rest follow back to back
    assert r["exposed_s"] == pytest.approx(r["backward_s"] / k + k * cost.seconds - r["backward_s"], rel=1e-9)
    assert r["latency_s"] == pytest.approx(k * cost.latency_s)


def test_tiny_buckets_pay_latency_and_one_bucket_cannot_overlap():
    rows = bucket_model.exposed_by_bucket_size(1.5e9, 64, 1024, [1e6, 2e8, 3e9], H)
    tiny, middle, whole = (r["exposed_s"] for r in rows)
    assert middle < tiny and middle < whole
    assert rows[0]["buckets"] == 3000 and rows[-1]["buckets"] == 1


# ------------------------------------------------------------------ chapter 5: lanes and figures
def _timeline_row(t0=10.0):
    return {"compute": [(t0, t0 + 0.01, "forward"), (t0 + 0.01, t0 + 0.03, "backward"), (t0 + 0.035, t0 + 0.04, "step")],
            "comm": [(t0 + 0.02, t0 + 0.025, "bucket0"), (t0 + 0.026, t0 + 0.034, "bucket1")],
            "wait_after_backward_s": 0.004}


def test_bucket_lanes_are_ms_since_the_step_began():
    lanes = ddp_plots.bucket_lanes(_timeline_row())
    assert lanes["compute"]["forward"] == pytest.approx((0.0, 10.0))
    assert lanes["compute"]["backward"] == pytest.approx((10.0, 30.0))
    assert list(lanes["buckets"]) == [0, 1]
    assert lanes["buckets"][1] == pytest.approx((26.0, 34.0))
    assert lanes["wait"] == pytest.approx((30.0, 34.0))


def test_chapter_5_figures_build():
    rows = [_timeline_row(), _timeline_row(5.0)]
    fig = ddp_plots.bucket_lanes_figure({"bucketed": rows, "overlapped": rows}, ["bucket 0", "bucket 1"])
    assert all(ax.get_title() for ax in fig.axes) and fig.axes[-1].get_xlabel()
    ops = {"per_parameter": {"calls": 530, "scalar_reads": 53}, "foreach": {"calls": 116, "scalar_reads": 106},
           "flat": {"calls": 40, "scalar_reads": 4}}
    fig = ddp_plots.optimizer_calls_figure(ops, {"per_parameter": 53, "foreach": 53, "flat": 4})
    assert fig.axes[0].get_xlabel() and fig.axes[0].get_title()
    for fig in (ddp_plots.bucket_size_figure(1.5e9, 1024), ddp_plots.tokens_to_hide_figure(1.5e9)):
        ax = fig.axes[0]
        assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title()


def test_tokens_to_hide_figure_marks_where_the_lines_cross():
    fig = ddp_plots.tokens_to_hide_figure(1.5e9, n=64, nics=(8,))
    dots = [line for line in fig.axes[0].lines if line.get_marker() == "o"]
    per_token = cm.BACKWARD_SHARE * cm.compute_seconds(1.5e9, 1, H)
    for dot, gpus in zip(dots, (8, 64)):
        t = dot.get_xdata()[0]
        assert t == pytest.approx(cm.min_tokens_to_hide(0, 1.5e9, gpus, H))
        # where the backward's time equals the all-reduce's
        assert per_token * t == pytest.approx(cm.step_estimate(0, 1.5e9, gpus, 1, H).comm_s, rel=1e-9)


# ------------------------------------------------------------------ the appendix
def test_appendix_figures_build_from_the_rows():
    bus, e2e = cost_checks.bus_rows(), cost_checks.end_to_end_rows()
    speed = cost_checks.speedup_rows(e2e)
    for fig in (cost_check_plots.bus_figure(bus), cost_check_plots.zeropp_figure(e2e),
                cost_check_plots.speedup_figure(speed), cost_check_plots.errors_figure(bus + e2e + speed)):
        assert any(ax.get_xlabel() or ax.get_ylabel() for ax in fig.axes)
        assert any(ax.get_title() for ax in fig.axes) or fig._suptitle is not None
    # the summary draws one point per row
    fig = cost_check_plots.errors_figure(bus + e2e + speed)
    points = sum(len(line.get_xdata()) for line in fig.axes[0].lines if line.get_marker() == "o")
    assert points == len(bus + e2e + speed)


def test_duplicated_memory_figure_stacks_what_each_rank_holds():
    psi = 1000
    reports = [{"params": 2 * psi, "grads": 2 * psi + 2, "optimizer": 12 * psi + 8}] * 2
    ax = ddp_plots.duplicated_memory_figure(reports, psi).axes[0]
    heights = [p.get_height() for p in ax.patches]
    assert len(heights) == 9                                    # 3 bars x 3 parts
    assert sum(heights[6:]) == pytest.approx(16 * psi / 1e6)    # the paper's bar: 16 psi bytes, in MB
    assert ax.get_ylabel() and ax.get_title()


def test_aten_calls_counts_adamw_per_tensor():
    import torch
    from zerolab.book.dp_demo import aten_calls

    params = [torch.nn.Parameter(torch.randn(10)) for _ in range(5)]
    for p in params:
        p.grad = torch.randn(10)
    one_by_one = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    one_by_one.step()
    per_step = aten_calls(one_by_one.step)
    assert per_step["calls"] % len(params) == 0 and per_step["calls"] > 5 * len(params)   # the same few ops per tensor
    assert per_step["scalar_reads"] == len(params)                # one step count read back per tensor
    twice = [torch.nn.Parameter(torch.randn(10)) for _ in range(10)]
    for p in twice:
        p.grad = torch.randn(10)
    opt = torch.optim.AdamW(twice, lr=1e-3, foreach=False)
    opt.step()
    assert aten_calls(opt.step)["calls"] == 2 * per_step["calls"]     # twice the tensors, twice the calls
