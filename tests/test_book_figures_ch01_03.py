"""The data behind chapters 1-3's figures, against closed forms, and the figures' labels."""

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

import zerolab as zl
from zerolab.book import fp_plots, memory_demo, memory_plots
from zerolab.book import mixed_precision_demo as demo
from zerolab.theory import numerics as N


def test_running_sum_is_exact_while_the_terms_fit_and_stalls_where_half_the_spacing_exceeds_the_term():
    # 0.125 * k is exact in fp16 up to 12.5: every partial sum is the exact one
    assert fp_plots.running_sum(0.125, 100, "fp16") == [0.125 * k for k in range(1, 101)]
    sums = fp_plots.running_sum(0.1, 4096, "fp16")
    assert sums[-1] == 256.0 == N.sum_naive([0.1] * 4096, "fp16")
    first = sums.index(256.0)
    assert all(s == 256.0 for s in sums[first:])              # stuck: 0.1 < ulp(256) / 2 = 0.125
    assert N.ulp(256.0, "fp16") / 2 > 0.1 > N.ulp(128.0, "fp16") / 2
    assert all(b > a for a, b in zip(sums[:first], sums[1:first + 1]))   # it rose at every step before


def test_stalled_update_paths():
    lr, steps = 1e-4, 200
    paths = demo.stalled_update_paths(lr, steps)
    assert all(len(p) == steps for p in paths.values())
    assert paths["fp16 weight"] == [1.0] * steps               # lr < ulp(1) / 4, the spacing below 1 halved
    for k, (master, copy) in enumerate(zip(paths["fp32 master"], paths["fp16 of master"]), start=1):
        assert abs(master - (1 - lr * k)) < 1e-5               # fp32 round-off over 200 subtractions
        assert copy == torch.tensor(master).half().item()      # the copy is the master's cast
        assert abs(copy - master) <= 2.0**-12                  # half the fp16 spacing below 1
    assert demo.stalled_update_demo(lr, steps) == {k: p[-1] for k, p in paths.items()}


@pytest.mark.slow
def test_replicated_step_reports_bytes_and_values_under_their_own_names():
    ranks = zl.launch(memory_demo.replicated_step, world_size=2, args=("nano", 4))
    for r in ranks:
        assert r["params"] == r["grads"] == 4 * r["numel"]      # bytes, fp32
        assert r["total"] == r["params"] + r["grads"] + r["optimizer"]
        assert r["param_values"].numel() == r["numel"]
    assert torch.equal(ranks[0]["param_values"], ranks[1]["param_values"])


def _labelled(fig):
    for ax in fig.axes:
        assert ax.get_xlabel() or not ax.has_data(), ax
        assert ax.get_ylabel() and ax.get_title(), ax
    return True


def test_figures_have_labelled_axes_and_titles():
    rows = {"fp32": dict(params=4, grads=4, master=0, **{"moments+counters": 8.0}, **{"step increment": 1.0,
                                                                                    "peak during step": 17.0}),
            "fp16": dict(params=2, grads=2, master=4, **{"moments+counters": 8.0}, **{"step increment": 5.0,
                                                                                    "peak during step": 21.0})}
    ranks = [dict(rank=r, params=2**20, grads=2**20, optimizer=2**21, total=2**22, bytes_sent=2**20) for r in (0, 1)]
    figs = [fp_plots.plot_stochastic_rounding([1.0] * 3, [1.0, 1.1, 1.2], [[1.0] * 3], 0.1),
            fp_plots.plot_running_sum(0.1, 64, "fp16"),
            fp_plots.plot_bytes_per_param(rows),
            fp_plots.plot_stalled_update(demo.stalled_update_paths(1e-4, 10), 1e-4),
            memory_plots.plot_attention_bytes([8, 16], [2**20, 2**21], [2**20 + 4096, 2**21 + 16384], 1, 1, 1),
            memory_plots.plot_replicas(ranks),
            memory_plots.plot_budget({"a": {"model states": 24e9, "activations": 8e9}}, 32e9, "t")]
    assert all(_labelled(f) for f in figs)
    matplotlib.pyplot.close("all")
