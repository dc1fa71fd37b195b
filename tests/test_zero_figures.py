"""The data behind chapters 6 to 8's new figures, against closed forms.

* zero3_trace.sent_by_phase on a real ZeRO-3 step: the forward all-gathers, the backward
  all-gathers and the reduce-scatters each send (N-1)/N of the model's padded fp32 bytes;
* zero3_trace.gathered_bytes: the most gathered bytes held at once are the root plus one block
  without prefetch and the root plus two blocks with prefetch=1, and nothing is left gathered
  when the step ends;
* zero3_trace on a hand-written trace (no ranks): the bookkeeping alone;
* zero3_cost.exposed_ms: zero above the tokens per GPU that hide the traffic, and not below;
* the figures draw (labelled axes, a title) from those numbers.
"""

import matplotlib

matplotlib.use("Agg")

import pytest

import zerolab as zl
from zerolab.book import zero3_cost, zero3_demo, zero3_plots, zero3_trace, zero_plots
from zerolab.theory import cost_model as cm


def test_trace_bookkeeping_by_hand():
    events = [(0.0, 0, "root", "gathering", "forward"), (0.1, 0, "a", "gathering", "forward"),
              (0.2, 0, "root", "gathered", "forward"), (0.3, 0, "a", "released", "forward"),
              (0.4, 0, "a", "gathering", "backward"), (0.5, 0, "a", "reduce_scatter", "backward"),
              (0.6, 0, "a", "released", "backward"), (0.7, 0, "root", "released", "backward")]
    held = zero3_trace.gathered_bytes(events, {"root": 10, "a": 100})
    assert [b for _, b in held] == [10, 110, 110, 10, 110, 110, 10, 0]
    records = [("all_gather", "gather:root", 0, 1, 5), ("all_gather", "gather:a", 0, 1, 50),
               ("all_gather", "gather:a", 0, 1, 50), ("reduce_scatter", "reduce:a", 0, 1, 50),
               ("all_reduce", "used", 0, 1, 3)]
    assert zero3_trace.sent_by_phase(events, records) == {
        "forward all-gather": 55, "backward all-gather": 50, "reduce-scatter": 50, "other": 3}


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4])
def test_sent_by_phase_is_the_model_three_times(n):
    res = zl.launch(zero3_demo.zero3_run, n, args=("nano", (1,)))
    units = res[0]["units"]
    padded = sum(units.values())
    for r in res:
        parts = zero3_trace.sent_by_phase(r[1]["events"], r[1]["records"])
        one = (n - 1) * padded // n * 4          # (N-1)/N of the padded fp32 model
        assert parts["forward all-gather"] == parts["backward all-gather"] == parts["reduce-scatter"] == one
        assert sum(parts.values()) == sum(rec[4] for rec in r[1]["records"])   # every record, once
        assert parts["other"] < 0.01 * one                                      # the checks' flags


@pytest.mark.slow
def test_gathered_bytes_root_plus_blocks():
    tp = zl.launch(zero3_demo.prefetch_timing, 2, args=("small", 1, 4, 1))[0]
    unit_bytes = {u: 4 * k for u, k in tp["units"].items()}
    blocks = sorted((b for u, b in unit_bytes.items() if u != "root"), reverse=True)
    for pf, most in ((0, unit_bytes["root"] + blocks[0]), (1, unit_bytes["root"] + blocks[0] + blocks[1])):
        trace = zero3_trace.gathered_bytes(tp["trace"][pf]["events"], unit_bytes)
        assert max(b for _, b in trace) == most, pf
        assert trace[-1][1] == 0
    fig = zero3_plots.gathered_bytes({f"prefetch={pf}": (tp["trace"][pf]["events"], tp["trace"][pf]["t0"])
                                      for pf in (0, 1)}, unit_bytes, 4 * tp["psi"])
    ax = fig.axes[0]
    assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title()


def test_exposed_ms_vanishes_above_the_threshold():
    psi, n = 7.5e9, 8
    for stage in (0, 3):
        hide = cm.min_tokens_to_hide(stage, psi, n, cm.H100_CLUSTER)
        below, above = zero3_cost.exposed_ms(stage, psi, n, [0.5 * hide, 1.01 * hide])
        assert below > 0 and above == pytest.approx(0, abs=1e-9)
    fig = zero3_plots.exposed_vs_tokens({"DDP": ([64, 4096], zero3_cost.exposed_ms(0, psi, n, [64, 4096]))})
    assert fig.axes[0].get_xlabel() == "tokens per GPU per step"


def test_chapter6_figures_draw():
    memory = {"params": 400, "grads": 400, "optimizer": 200}
    fig = zero_plots.model_state_bars({"a": memory, "b": dict(memory, optimizer=800)}, 100)
    assert fig.axes[0].get_ylabel() == "bytes per parameter held by one rank"
    views = [[("w", (4, 2), (6,)), ("b", (2,), (0,))], [("w", (4, 2), (2,)), ("b", (2,), (2,))]]
    fig = zero_plots.optimizer_views(views)
    assert fig.axes[0].get_xlabel() == "elements of the parameter"
    with pytest.raises(AssertionError):          # pieces that do not add up to the parameter
        zero_plots.optimizer_views([[("w", (4, 2), (6,))], [("w", (4, 2), (1,))]])
    fig = zero_plots.state_shares({"x": [10, 12], "y": [11, 11]}, 11)
    assert fig.axes[0].get_ylabel() == "optimizer state held (KiB)"
