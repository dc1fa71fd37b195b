"""Lab 8 (ZeRO-3 as compiler passes), graded: the library's passes pass every check, a student's
passes written from the stub file's brief alone pass too, the untouched stubs are reported as
stubs, and each planted mistake fails with the failure it was planted for and its own words.

tests/test_labs.py grades every registered lab the same way from its DIAGNOSES table; lab 8's
words are DIAGNOSES_COMPILED below (the same entry belongs there under "compiled").
"""

import os
import textwrap

import pytest

from zerolab.labs import grade_cases
from zerolab.labs.worker import load_lab

pytestmark = pytest.mark.slow     # launches ranks

LABS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "labs")

FROM_THE_BRIEF = textwrap.dedent('''
    from zerolab.compiled import collectives
    from zerolab.compiled.nodes import is_compute, last_use, positions
    from zerolab.compiled.shard import free_after, gather_before, views_per_region


    def shard(step, world):
        views_per_region(step)
        for param in step.params():
            pos = positions(step.graph)
            loss = pos[step.loss_node()]
            forward = [u for u in param.users if pos[u] <= loss]
            backward = [u for u in param.users if pos[u] > loss]
            for readers in (forward, backward):
                if not readers:
                    continue
                first = readers[0]
                for r in readers:
                    if pos[r] < pos[first]:
                        first = r
                weight = gather_before(step, param, first, world)
                for r in readers:
                    r.replace_input_with(param, weight)
                free_after(step, weight, last_use(weight, positions(step.graph)))
        return step


    def prefetch(step, depth):
        starts = [n for n in step.graph.nodes if n.target is collectives.all_gather_start]
        for start in starts:
            target = start
            counted = 0
            node = start.prev
            while counted < depth:
                if node.op in ("root", "placeholder") or node in start.all_input_nodes:
                    break
                if is_compute(node):
                    counted += 1
                    target = node
                node = node.prev
            if target is not start:
                target.prepend(start)
        return step
''')

# every planted mistake and words its diagnosis must contain (the first failure's line, the graded
# code it names, what to do): what it saw, against what
DIAGNOSES_COMPILED = {
    "gathers_after_first_use": ("completes at wait (node 34), after embedding (node 32)", "FIRST reader"),
    "frees_after_first_reader": ("freed at free_6 (node 60), before addmm (node 64)", "LAST reader"),
    "never_frees": ("never freed", "ZeRO-1's memory", "free_after"),
    "gathers_once": ("read by the forward and by the backward", "across the gap", "once per region"),
    "gathers_forward_only": ("native_layer_norm_backward_4 (node 404) reads blocks_0_ln1_weight itself",
                             "16 of its 32 elements", "EVERY reader"),
    "prefetch_past_the_top": ("now starts at all_gather_start (node 566), after wait (node 32)", "waits for it",
                              "node.op == 'root'"),
    "moves_the_wait": ("1 operation above its first reader embedding (node 37)", "move only the start"),
    "counts_every_node": ("starts 0 operations before its wait; with depth 1 it should be 1", "is_compute(node)"),
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    lab = load_lab("compiled")
    mine = tmp_path_factory.mktemp("lab8") / "from_the_brief.py"
    mine.write_text(FROM_THE_BRIEF)
    cases = [("compiled", ("reference", None)), ("compiled", ("file", str(mine))),
             ("compiled", ("file", os.path.join(LABS_DIR, lab.stub_file)))]
    cases += [("compiled", ("mistake", m.name)) for m in lab.mistakes]
    out = grade_cases(cases)
    return {spec[1] if spec[0] == "mistake" else os.path.basename(spec[1] or "reference"): r
            for (_, spec), r in zip(cases, out)}


def test_the_library_and_a_student_from_the_brief_pass_every_check(reports):
    titles = ["it runs"] + [c.title for c in load_lab("compiled").checks]
    for name in ("reference", "from_the_brief.py"):
        assert reports[name].passed, str(reports[name])
        assert [v.check for v in reports[name].verdicts] == titles


def test_the_stub_file_is_wired_to_the_grader(reports):
    first = reports["lab8_compiled.py"].first_failure
    assert first.check == "it runs" and first.key == "stub", str(reports["lab8_compiled.py"])
    assert "lab8_compiled.py" in first.line and "line" in first.line


@pytest.mark.parametrize("mistake", list(DIAGNOSES_COMPILED))
def test_each_planted_mistake_gets_its_own_diagnosis(reports, mistake):
    report = reports[mistake]
    first = report.first_failure
    assert first is not None, f"{mistake} passed every check:\n{report}"
    assert first.key == load_lab("compiled").mistake(mistake).expect, str(report)
    said = " ".join((first.line, first.where, first.hint))
    missing = [w for w in DIAGNOSES_COMPILED[mistake] if w not in said]
    assert not missing, f"{mistake}: {missing} not in\n{report}"
    assert "compiled_mistakes.py, line " in said, str(report)
    assert first.section and f"Re-read: {first.section}." in str(report).replace("\n        ", " ")


def test_every_planted_mistake_fails_its_own_way_and_has_its_words(reports):
    lab = load_lab("compiled")
    assert {m.name for m in lab.mistakes} == set(DIAGNOSES_COMPILED)
    keys = [reports[m.name].first_failure.key for m in lab.mistakes]
    assert len(set(keys)) == len(keys) >= 5, keys
