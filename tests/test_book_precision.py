"""The helpers chapters 1 and 2 print from, against references worked out independently:
the scale rules read off DeepSpeed's and PyTorch's sources by hand, float64 and torch's own
fp16 arithmetic, and byte counts in closed form."""

import math

import pytest
import torch

import zerolab as zl
from zerolab.book import mixed_precision_demo as demo
from zerolab.book import reduction_dtype, scaler_rules

# ------------------------------------------------------------------ loss-scaling rules

ALTERNATING = [1, 0] * 4          # four isolated overflows
BURST = [1, 1, 1, 1, 0]           # four in a row


def log2s(scales):
    return [int(math.log2(s)) for s in scales]


def test_gradscaler_halves_on_every_overflow():
    # GradScaler's documented rule: scale * backoff_factor (0.5) at each overflow, no hysteresis
    for pattern in (ALTERNATING, BURST):
        expected = [16 - sum(pattern[:i + 1]) for i in range(len(pattern))]
        assert log2s(scaler_rules.gradscaler_trajectory(pattern)) == expected


def test_deepspeed_default_spends_its_hysteresis_once():
    # read off update_scale with delayed_shift=2, consecutive_hysteresis=False: the first overflow
    # only lowers the count to 1; clean steps do not refill it, so every later overflow halves
    assert log2s(scaler_rules.deepspeed_trajectory(ALTERNATING)) == [16, 16, 15, 15, 14, 14, 13, 13]
    assert log2s(scaler_rules.deepspeed_trajectory(BURST)) == [16, 15, 14, 13, 13]


def test_deepspeed_consecutive_refills_on_clean_steps_only():
    assert log2s(scaler_rules.deepspeed_trajectory(ALTERNATING, consecutive_hysteresis=True)) == [16] * 8
    # in a burst the back-off does not refill it: halves at the 2nd, 3rd and 4th overflow
    assert log2s(scaler_rules.deepspeed_trajectory(BURST, consecutive_hysteresis=True)) == [16, 15, 14, 13, 13]


def test_deepspeed_refills_when_the_scale_grows_and_raises_at_its_minimum():
    # after scale_window clean steps since the last overflow the scale doubles and the count refills
    pattern = [1, 0, 0, 0, 1, 0]
    assert log2s(scaler_rules.deepspeed_trajectory(pattern, scale_window=3)) == [16, 16, 16, 17, 17, 17]
    s = scaler_rules.DeepSpeedDynamicLossScaler(init_scale=2.0, delayed_shift=1)
    s.update_scale(True)                     # 2 -> 1, the minimum
    with pytest.raises(Exception, match="minimum"):
        s.update_scale(True)


def test_zerolab_counts_overflows_in_a_row_and_refills_after_backing_off():
    assert log2s(scaler_rules.zerolab_trajectory(ALTERNATING)) == [16] * 8
    assert log2s(scaler_rules.zerolab_trajectory(BURST)) == [16, 15, 15, 14, 14]


# ------------------------------------------------------------------ the all-reduce's dtype


def test_inputs_are_exact_fp16_numbers():
    for r in range(3):
        g = torch.Generator().manual_seed(1000 + r)
        m = torch.randint(-2047, 2048, (4096,), generator=g).double()
        e = torch.randint(-14, 1, (4096,), generator=g).double()
        assert torch.equal(reduction_dtype.inputs(r).double(), m * torch.pow(2.0, e))


@pytest.mark.slow
def test_gloo_all_reduce_adds_in_fp16():
    results = zl.launch(reduction_dtype.all_reduce_fp16, 3)
    xs = [reduction_dtype.inputs(r) for r in range(3)]
    got = results[0]["sum"]
    assert got.dtype == torch.float16 and all(torch.equal(r["sum"], got) for r in results)
    # reference: every chain of two fp16 additions, computed here with torch's fp16 add
    chains = [(xs[a] + xs[b]) + xs[c] for a, b, c in ((0, 1, 2), (0, 2, 1), (1, 2, 0))]
    assert bool(torch.stack([ch == got for ch in chains]).any(0).all())
    exact_once = (xs[0].double() + xs[1].double() + xs[2].double()).to(torch.float16)
    assert int((got != exact_once).sum()) > 0
    c = reduction_dtype.compare(results)
    assert c["differ from the exact sum rounded once"] == int((got != exact_once).sum())


# ------------------------------------------------------------------ the training helpers


def test_naive_fp16_loses_every_update_far_below_half_a_spacing():
    # AdamW's first update of a weight is lr * g / (|g| + eps), at most lr = 1e-9 in size: below half
    # the spacing of any fp16 number (at least 2^-25 ~ 3e-8), so nothing may move in pure fp16,
    # (with master weights, only a master within a hair of a rounding boundary of its fp16 copy
    # can carry that copy across it)
    naive = demo.train("naive fp16", 2, lr=1e-9, track_moved=True)
    assert naive["lost"] == [1.0, 1.0] and naive["moved"] == [0.0, 0.0]
    mixed = demo.train("fp16", 2, lr=1e-9, track_moved=True)
    assert 0.0 <= mixed["moved"][-1] < 0.01


def test_update_threshold_is_half_the_fp16_spacing_of_the_median_weight():
    t = demo.update_threshold_lr()
    w = torch.cat([p.detach().abs().flatten() for p in demo.make_model().parameters()])
    assert t["median |w|"] == w.median().item()
    m16 = torch.tensor(t["median |w|"], dtype=torch.float16)
    if m16.float().item() > t["median |w|"]:        # the fp16 neighbour at or below the median
        m16 = torch.nextafter(m16, torch.tensor(0.0, dtype=torch.float16))
    spacing = (torch.nextafter(m16, torch.tensor(1.0, dtype=torch.float16)) - m16).item()
    assert t["threshold lr"] == spacing / 2


def test_the_step_adds_exactly_the_fp32_gradients():
    rows = {p: demo.memory_per_param(p) for p in ("fp32", "fp16")}
    n = rows["fp16"]["n_params"]
    n_tensors = len(list(demo.make_model().parameters()))
    for r in rows.values():
        # model states: 16 bytes per parameter plus one 4-byte AdamW step counter per tensor
        assert r["held at step start"] * n == 16 * n + 4 * n_tensors
        assert r["peak during step"] == r["held at step start"] + r["step increment"]
    assert (rows["fp16"]["step increment"] - rows["fp32"]["step increment"]) * n == 4 * n


def test_step_time_spread_quartiles():
    run = {"seconds": [9.0] * 5 + [float(x) for x in range(1, 10)]}    # 5 warm-up steps, then 1..9
    assert demo.step_time_spread(run) == {"q1": 3.0, "median": 5.0, "q3": 7.0, "n": 9}


# ------------------------------------------------------------------ the chapter's misuse demo


def test_chapter_2_refuses_every_bad_call_it_shows():
    # chapter 2 shows the mistakes the API refuses up front: each one must still raise (the cell asserts it
    # too), and the committed output must show one error per bad call, so a call that stops raising cannot
    # leave the page silently one error short
    import json
    import pathlib

    from zerolab.engines.single import SingleProcess
    from zerolab.precision import LossScaler, MixedPrecision

    nb = json.loads((pathlib.Path(__file__).resolve().parents[1] / "chapters" / "02_mixed_precision.ipynb").read_text())
    cell = next(c for c in nb["cells"] if c["cell_type"] == "code" and "bad_calls = {" in "".join(c["source"]))
    names = {"torch": torch, "zl": zl, "demo": demo, "SingleProcess": SingleProcess, "MixedPrecision": MixedPrecision,
             "LossScaler": LossScaler}
    exec("".join(cell["source"]), names)                    # raises AssertionError if a bad call is accepted
    assert names["refused"] == list(names["bad_calls"]) and len(names["bad_calls"]) == 4
    printed = "".join("".join(o.get("text", "")) for o in cell["outputs"])
    assert printed.count("Error: ") == len(names["bad_calls"])
