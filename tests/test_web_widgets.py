"""The in-page calculators' JavaScript against zerolab's Python, run by node on grids of inputs.

zerolab/book/web_widgets.py writes each formula a second time in JavaScript (FORMULAS_JS) so that
the built book computes without a kernel. These tests evaluate that JavaScript with node and compare
every value, and every line the reader sees, with what zerolab's Python functions give: a slip in
either implementation fails them. Without node those are skipped, saying why; the checks of the
HTML itself run anyway.
"""

from __future__ import annotations

import itertools
import json
import random
import re
import shutil
import subprocess

import pytest
import torch

from zerolab.theory import calculator as calc
from zerolab import memory
from zerolab.theory import numerics as N
from zerolab.book import web_widgets as W

NODE = shutil.which("node")
needs_node = pytest.mark.skipif(NODE is None, reason="node (Node.js) is not installed, so the calculators' "
                                                     "JavaScript cannot be evaluated here")

# Calls every function named in the cases file on each argument list, and prints the results as JSON.
DRIVER = r"""
const fns = {zlFixed, zlG, zlRepr, zlDecode, zlBytesPerParam, zlModelStateBytes, zlMaxParams, zlMemoryLines,
             zlActivationBytes, zlPlan, zlPlanCells};
const cases = JSON.parse(require("fs").readFileSync(process.argv[2], "utf8"));
const out = {};
for (const [name, calls] of Object.entries(cases)) {
  out[name] = calls.map((args) => {
    const r = fns[name](...args);
    return name === "zlDecode" ? [zlRepr(r.value), r.kind] : r;   // JSON has no NaN or inf: compare repr
  });
}
process.stdout.write(JSON.stringify(out));
"""


def run_js(tmp_path, cases: dict) -> dict:
    script, data = tmp_path / "formulas.js", tmp_path / "cases.json"
    script.write_text(W.FORMULAS_JS + DRIVER)
    data.write_text(json.dumps(cases))
    done = subprocess.run([NODE, str(script), str(data)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


# ------------------------------------------------------------------ numbers printed as Python prints them


@needs_node
def test_number_formatting_matches_python(tmp_path):
    rng = random.Random(17)
    # exact ties (half to even in Python), values that round up to the next power of ten, signs, zeros,
    # and random floats over 24 decades
    xs = [0.0, -0.0, 0.5, 1.5, 2.5, 0.125, 1.125, 1.875, -0.125, 120.5, 121.5, 1234.5, 9.9995, 9.99995,
          999.5, 99.95, 0.00012345, 1.5e-05, 1e-05, 0.0001, 1e16, 1.2345e16, 65504.0, 1e21, 123456789.125,
          -90.078125, 2 ** -24, 2 ** -25, 3.4028234663852886e38, 7.5, 16.640625, 1.8750000000000002]
    xs += [rng.uniform(-1, 1) * 10 ** rng.uniform(-6, 18) for _ in range(3000)]
    xs += [round(rng.uniform(0, 2000), rng.randrange(0, 4)) + 0.5 * 10 ** -rng.randrange(1, 4) for _ in range(2000)]
    cases = {"zlFixed": [[x, d, c] for x in xs for d in (0, 1, 2) for c in (False, True)],
             "zlG": [[x, p] for x in xs for p in (3, 6)],
             "zlRepr": [[x] for x in xs]}
    js = run_js(tmp_path, cases)
    assert js["zlFixed"] == [format(x, f"{',' if c else ''}.{d}f") for x, d, c in cases["zlFixed"]]
    assert js["zlG"] == [format(x, f".{p}g") for x, p in cases["zlG"]]
    assert js["zlRepr"] == [repr(x) for (x,) in cases["zlRepr"]]


# ------------------------------------------------------------------ chapter 1: bit patterns


def python_decode(bits: torch.Tensor, fmt) -> list:
    """repr and kind of each pattern, from zerolab.theory.numerics.from_bits and the format's landmarks."""
    values = N.from_bits(bits, fmt).tolist()
    tiny = N.smallest_normal(fmt)
    kinds = ["nan" if v != v else "inf" if abs(v) == float("inf") else "zero" if v == 0
             else "subnormal" if abs(v) < tiny else "normal" for v in values]
    return [[repr(v), k] for v, k in zip(values, kinds)]


@needs_node
def test_bit_patterns_match_numerics(tmp_path):
    patterns = {}
    for name in ("fp16", "bf16", "e4m3", "e5m2"):      # every pattern of the 8- and 16-bit formats
        patterns[name] = torch.arange(2 ** N.get_format(name).bits, dtype=torch.int64)
    g = torch.Generator().manual_seed(0)              # fp32: its landmarks and 20,000 random patterns
    edges = [0, 1, 2 ** 23 - 1, 2 ** 23, 0x3F800000, 0x7F7FFFFF, 0x7F800000, 0x7F800001, 0x7FC00000, 0xFF800000,
             0x80000000, 0x80000001, 0xFFFFFFFF]
    patterns["fp32"] = torch.cat([torch.tensor(edges), torch.randint(0, 2 ** 32, (20000,), generator=g)])
    cases, expected = {"zlDecode": []}, []
    for name, bits in patterns.items():
        f = N.get_format(name)
        cases["zlDecode"] += [[b, f.exponent_bits, f.mantissa_bits, f.has_inf] for b in bits.tolist()]
        expected += python_decode(bits, name)
    assert run_js(tmp_path, cases)["zlDecode"] == expected


# ------------------------------------------------------------------ chapter 3: the memory calculator

SLIDER_BILLIONS = sorted({float(f"{10 ** (k / 20 - 1):.3g}") for k in range(101)} | {7.5, 1.5, 175.0})


@needs_node
def test_memory_formulas_match_zerolab(tmp_path):
    states = [[b * 1e9, n_d, s] for b in SLIDER_BILLIONS for n_d in W.ND_OPTIONS for s in range(4)]
    most = [[gb * 1e9, n_d, s, 12, n_m] for gb in (8, 16, 32, 80, 192) for n_d in W.ND_OPTIONS
            for s in range(4) for n_m in W.NM_OPTIONS]
    js = run_js(tmp_path, {"zlModelStateBytes": states, "zlMaxParams": most})
    assert js["zlModelStateBytes"] == pytest.approx([memory.model_state_bytes(*a) for a in states], rel=1e-12)
    assert js["zlMaxParams"] == pytest.approx(
        [memory.max_params(d, n_d, s, k, n_m=n_m) for d, n_d, s, k, n_m in most], rel=1e-12)
    # the paper's figures, typed in: 7.5B on 64 GPUs is 120, 31.4, 16.6 and 1.88 GB (Table 1)
    table1 = [round(v / 1e9, 2) for v in run_js(tmp_path, {"zlModelStateBytes": [[7.5e9, 64, s] for s in range(4)]})
              ["zlModelStateBytes"]]
    assert table1 == [120.0, 31.41, 16.64, 1.88]


@needs_node
def test_memory_calculator_prints_what_chapter_3_printed(tmp_path):
    grid = [[b, n_d, s, gb] for b in SLIDER_BILLIONS for n_d in W.ND_OPTIONS for s in range(4)
            for gb in (8, 16, 32, 40, 80, 192)]
    assert run_js(tmp_path, {"zlMemoryLines": grid})["zlMemoryLines"] == [W._memory_lines(*a) for a in grid]


# ------------------------------------------------------------------ chapter 10: the planner

PLAN_GRID = list(itertools.product((0.1, 1.5, 7.5, 13.3, 175.0, 1000.0), (8, 32, 80), (1, 16, 64, 1024),
                                   W.NM_OPTIONS[::2], (1, 8, 64), (128, 1024, 8192), (1, 32, 200),
                                   (256, 4096, 16384), (True, False)))
ARGS = ("psi_billions", "device_gb", "n_d", "n_m", "batch", "seq", "layers", "hidden", "ckpt")


@needs_node
def test_activation_bytes_match_calculator(tmp_path):
    cases = [[h, b, s, L, n_m, ck, ck and n_m > 1] for _, _, _, n_m, b, s, L, h, ck in PLAN_GRID[::7]]
    js = run_js(tmp_path, {"zlActivationBytes": cases})["zlActivationBytes"]
    assert js == pytest.approx([calc.activation_bytes(h, b, s, L, n_m=n_m, checkpointing=ck, partitioned=pa)
                                for h, b, s, L, n_m, ck, pa in cases], rel=1e-12)


@needs_node
def test_plan_rows_match_calculator(tmp_path):
    cases = [[psi * 1e9, gb, n_d, n_m, act] for psi in (0.1, 7.5, 1000.0) for gb in (8, 32, 192)
             for n_d in W.ND_OPTIONS for n_m in W.NM_OPTIONS for act in (0.0, 2.15, 60.4)]
    js = run_js(tmp_path, {"zlPlan": cases})["zlPlan"]
    for args, rows in zip(cases, js):
        py = calc.plan(args[0], args[1], args[2], args[3], activations_gb=args[4])
        assert [r["stage"] for r in rows] == [r["stage"] for r in py]
        for key, pykey in (("states", "model_states_gb"), ("total", "total_gb"), ("room", "room_gb")):
            assert [r[key] for r in rows] == pytest.approx([r[pykey] for r in py], rel=1e-12, abs=1e-12)
        assert [r["fits"] for r in rows] == [r["fits"] for r in py]


@needs_node
def test_planner_table_matches_format_plan(tmp_path):
    cases = [[dict(zip(ARGS, a))] for a in PLAN_GRID]
    assert run_js(tmp_path, {"zlPlanCells": cases})["zlPlanCells"] == [W._plan_cells(*a) for a in PLAN_GRID]


# ------------------------------------------------------------------ the HTML itself


def widgets():
    return {"bits": W.bit_toggler(), "bits bf16": W.bit_toggler("bf16"), "memory": W.memory_calculator(),
            "planner": W.planner()}


def test_html_is_offline_deterministic_and_free_of_ids():
    first, again = widgets(), widgets()
    for name, obj in first.items():
        page = obj.data
        assert page == again[name].data, f"{name}: the HTML differs between two calls (nbval compares it)"
        assert not re.search(r"\bid=", page), f"{name}: an id could clash with another instance on the page"
        assert not re.search(r"(src|href)=|https?://|import\(|fetch\(", page), f"{name}: reaches for the network"


def test_default_answer_is_in_the_html_before_any_script_runs():
    assert "16.64 GB of model states per device -&gt; fits in 32 GB" in W.memory_calculator().data
    assert "<td>ZeRO-3 (P_os+g+p)</td><td>1.88</td>" in W.planner().data
    assert "<code>fp16</code> bits <code>0011110000000000</code> = <b>1.0</b> (normal)" in W.bit_toggler().data


@needs_node
def test_scripts_are_valid_javascript(tmp_path):
    for name, obj in widgets().items():
        (script,) = re.findall(r"<script>(.*?)</script>", obj.data, re.S)
        path = tmp_path / f"{name.replace(' ', '_')}.js"
        path.write_text(script)
        done = subprocess.run([NODE, "--check", str(path)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{name}: {done.stderr}"


@pytest.mark.parametrize("call", [lambda: W.memory_calculator(n_d=3), lambda: W.memory_calculator(stage=4),
                                  lambda: W.memory_calculator(device_gb=33), lambda: W.planner(seq=100),
                                  lambda: W.planner(n_m=3), lambda: W.bit_toggler("fp64")])
def test_values_off_the_sliders_are_refused(call):
    with pytest.raises(ValueError):
        call()
