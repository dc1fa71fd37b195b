"""Chapter 10's and 11's figure helpers: what they compute, checked against an independent count, and that each
draws from the data a chapter cell hands it (no ranks launched)."""

import difflib
import pathlib

import matplotlib

matplotlib.use("Agg")

from zerolab.book import bench_plots, own_model_figures as figs   # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_line_status_marks_what_a_unified_diff_adds_and_removes():
    before = ["a", "b", "c", "d"]
    after = ["a", "x", "c", "d", "e"]
    assert figs.line_status(before, after) == (["same", "removed", "same", "same"],
                                               ["same", "added", "same", "same", "added"])
    plain, ours = ((ROOT / "examples" / n).read_text().splitlines() for n in ("train_plain.py", "train_zerolab.py"))
    left, right = figs.line_status(plain, ours)
    diff = list(difflib.unified_diff(plain, ours, lineterm="", n=0))[2:]
    assert left.count("removed") == sum(d.startswith("-") for d in diff)
    assert right.count("added") == sum(d.startswith("+") for d in diff)
    assert figs._block_starts(["same", "added", "added", "same", "removed", "same", "added", "added", "added"]) == [1, 6]


def test_the_chapter_figures_draw_from_what_the_cells_hand_them():
    import matplotlib.pyplot as plt
    plain, ours = ((ROOT / "examples" / n).read_text().splitlines() for n in ("train_plain.py", "train_zerolab.py"))
    fig = figs.script_figure(plain, ours)
    assert [ax.get_title().split(":")[0] for ax in fig.axes] == ["train_plain.py", "train_zerolab.py"]
    over = {"fp16": {"rows": [(0, 16.0, False, False), (1, 8.0, False, False), (2, 8.0, "raised", False)]},
            "bf16": {"rows": [(0, None, True, True), (1, None, True, True)]}}
    figs.loss_scale_figure(over)
    figs.activations_figure({2: {"total": 10, "activations": 12}, 8: {"total": 10, "activations": 48}})
    t = {"matmul": 0.02, "attention": 0.003, "memory": 0.013, "optimizer": 0.012, "total": 0.048}
    fig = bench_plots.roofline_figure([("a step", t, 0.4)])
    assert sum(p.get_width() for p in fig.axes[0].patches) == __import__("pytest").approx(100)
    bench_plots.activation_figure([("x", 1.0, 60.0), ("y", 1.0, 5.0)], device_gb=32)
    plt.close("all")
