"""The labs' graders, graded: each passes the library's own engine and fails every planted mistake
with the failure it was planted for, and its own message.

Everything below is graded in ONE run (zerolab.labs.grade_cases: one launch per world size, the
cases in turn in the same ranks), because starting ranks that build an engine costs seconds:
every lab's reference, every planted mistake, the untouched stub files of labs/, two student
files written here (one that crashes, one that does not import), and the exact path of each lab
whose engine has a bitwise mode (zerolab.labs.exact). The tests read its reports.
"""

import inspect
import os
import textwrap

import pytest
import torch

import tolerances
from test_lab8_compiled import DIAGNOSES_COMPILED
from zerolab.labs import LABS, exact, grade_cases
from zerolab.labs.lab import Wrong
from zerolab.labs.__main__ import main as labs_cli
from zerolab.labs.worker import load_lab

pytestmark = pytest.mark.slow     # launches ranks or processes (make test-fast leaves it out)

LABS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "labs")
CRASHING = textwrap.dedent('''
    from zerolab.labs.ddp import ReferenceDDP

    class MyDDP(ReferenceDDP):
        def _reduce(self, b):
            raise ValueError("a bug in the student's _reduce")
''')


EMPTY = textwrap.dedent('''
    from zerolab.labs.ddp import DDPLab


    class MyDDP(DDPLab):
        pass
''')
NO_FLAT_MASTERS = textwrap.dedent('''
    from zerolab.labs.zero1 import ReferenceZeRO1


    class MyZeRO1(ReferenceZeRO1):
        def _lay_out_masters(self):
            n, r = self.world_size, self.rank
            self.shards = [slice(r * b.padded_numel // n, (r + 1) * b.padded_numel // n)
                           for b in self.buckets.buckets]
            self.buckets.bind_params()
            self.master_shards = [b.data[s] for b, s in zip(self.buckets.buckets, self.shards)]
            self._out = {}      # (self.flat_masters and self.masters never set)
''')


# lab 7 written from its brief alone (labs/lab7_views.py's docstrings): its own bookkeeping, not the
# library's, so the grader must not lean on anything the brief does not ask for
FROM_THE_BRIEF_VIEWS = textwrap.dedent('''
import torch

from zerolab.labs.views import ParamViewsLab, pack, unpack


class MyViews(ParamViewsLab):
    def _cut(self, i, flat, bucket, s):
        for p, off, size in zip(bucket.params, bucket.offsets, bucket.sizes):
            a, b = max(off, s.start), min(off + size, s.stop)
            if a >= b:
                self.view_of[id(p)] = flat.new_empty(0)
                self.where[id(p)] = None
                continue
            v = flat[a - s.start:b - s.start]
            if b - a == size:
                v = v.view(p.shape)
            self.view_of[id(p)] = v
            self.where[id(p)] = (i, a - s.start, b - s.start)
            self.piece[id(p)] = (a - off, b - off)

    def place(self, optimizer):
        self.order = []
        for g in optimizer.param_groups:
            self.order += list(g["params"])
            g["params"] = [self.view_of.get(id(p), p) for p in g["params"]]

    def point_grads(self, skip):
        for p in self.params:
            w = self.where[id(p)]
            v = self.view_of[id(p)]
            if w is None or id(p) in skip:
                v.grad = None
                continue
            i, a, b = w
            v.grad = self.masters[i].grad[a:b].view(v.shape)

    def pieces(self, local):
        mine = {}
        for k, p in enumerate(self.order):
            if k in local and self.where.get(id(p)) is not None:
                mine[k] = (self.piece[id(p)], local[k])
        return pack(mine)

    def assemble(self, local, blobs):
        out = {}
        for blob in blobs:
            for k, ((a, b), st) in unpack(blob).items():
                p = self.order[k]
                entry = out.setdefault(k, {})
                for name, val in st.items():
                    if torch.is_tensor(val) and val.dim() > 0:
                        if name not in entry:
                            entry[name] = torch.zeros(self.shape[id(p)], dtype=val.dtype)
                        entry[name].view(-1)[a:b] = val.reshape(-1)
                    else:
                        entry[name] = val
        return {k: out[k] for k in sorted(out)}

    def shard(self, state, groups):
        keys = [key for g in groups for key in g["params"]]
        out = {}
        for pos, key in enumerate(keys):
            if key not in state:
                continue
            p = self.order[pos]
            if self.where.get(id(p)) is None:
                continue
            a, b = self.piece[id(p)]
            shape = self.view_of[id(p)].shape
            out[key] = {name: (val.reshape(-1)[a:b].reshape(shape).clone()
                               if torch.is_tensor(val) and val.dim() > 0 else val)
                        for name, val in state[key].items()}
        return out
''')


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict:
    """{(lab, kind, name): Report} for every case, graded once for the whole module."""
    tmp = str(tmp_path_factory.mktemp("labs"))
    crashing = os.path.join(tmp, "crashing_ddp.py")
    broken = os.path.join(tmp, "broken_ddp.py")
    with open(crashing, "w") as f:
        f.write(CRASHING)
    with open(broken, "w") as f:
        f.write("class MyDDP(:\n")
    students = {"empty_ddp.py": EMPTY, "no_flat_masters.py": NO_FLAT_MASTERS,
                "from_the_brief_views.py": FROM_THE_BRIEF_VIEWS}
    for name, text in students.items():
        with open(os.path.join(tmp, name), "w") as f:
            f.write(text)
    cases = []
    for name in LABS:
        lab = load_lab(name)
        cases.append((name, ("reference", None)))
        cases += [(name, ("mistake", m.name)) for m in lab.mistakes]
        cases.append((name, ("file", os.path.join(LABS_DIR, lab.stub_file))))
        if exact.engine_of(lab) is not None:
            cases.append((name, ("bitwise", None)))
    cases += [("ddp", ("file", crashing)), ("ddp", ("file", broken)),
              ("ddp", ("file", os.path.join(tmp, "empty_ddp.py"))),
              ("zero1", ("file", os.path.join(tmp, "no_flat_masters.py"))),
              ("views", ("file", os.path.join(tmp, "from_the_brief_views.py")))]
    reports = grade_cases(cases)
    return {(name, spec[0], spec[1] if spec[0] != "file" else os.path.basename(spec[1])): report
            for (name, spec), report in zip(cases, reports)}


@pytest.mark.parametrize("name", list(LABS))
def test_the_library_passes_every_check(reports, name):
    report = reports[(name, "reference", None)]
    assert report.passed, str(report)
    assert [v.check for v in report.verdicts] == ["it runs"] + [c.title for c in load_lab(name).checks]


@pytest.mark.parametrize("name", list(LABS))
def test_every_planted_mistake_fails_with_its_own_message(reports, name):
    lab = load_lab(name)
    assert len(lab.mistakes) >= 5
    firsts = {}
    for mistake in lab.mistakes:
        report = reports[(name, "mistake", mistake.name)]
        first = report.first_failure
        assert first is not None, f"{mistake.name} passed every check:\n{report}"
        assert first.key == mistake.expect, f"{mistake.name}:\n{report}"
        assert first.line and first.section, str(report)
        firsts[mistake.name] = (first.key, first.line)
    keys = [key for key, _ in firsts.values()]
    assert len(set(keys)) == len(keys), f"two planted mistakes fail the same way: {firsts}"


# Every planted mistake and the words its diagnosis must contain (the first failure's line, the
# graded code it names, what to do): what it saw, against what, in the numbers or words that tell
# this mistake from the others. A new planted mistake adds its words here.
DIAGNOSES = {
    "ring": {
        "copies_instead_of_adding": ("[303.0, 306.0, 309.0]", "copied over yours", "ADDED"),
        "sends_the_wrong_chunk": ("landed in rank 0's chunk 1", "(r - s - 1) mod N"),
        "one_step_short": ("made 1 ring step;", "N - 1 = 2"),
        "gathers_into_the_wrong_chunk": ("chunk 1 holds chunk 2", "wrong place"),
        "forgets_the_all_gather": ("in its own chunk only", "all-gather half is missing"),
        "sends_everything_to_everyone": ("sent 72 B in 2 messages", "2(N-1)/N S = 48 B"),
        "runs_backwards": ("RIGHT neighbour's", "(r + 1) % N"),
        "receives_into_a_new_tensor": ("`recv` still holds the zeros", "rank 2, sent [21.0, 21.0]", "irecv(recv"),
        "gathers_by_adding": ("[1008.0, 1009.0, 1010.0]", "2 lower", "the -1", "no addition"),
        "all_gather_one_step_short": ("never arrived", "made 1 ring step,", "N - 1 = 2"),
        "splits_by_numel_over_n": ("10 elements on 3 ranks", "element 9 holds 10", "chunks of 4, 3, 3",
                                   "N + 1 chunks"),
        "averages": ("divided by N = 3, the mean", "element 0 holds 8", "24", "SUM"),
        "receives_from_the_right": ("hung in receives_from_the_right", "did not complete within 2 s"),
    },
    "scaler": {
        "grows_after_overflow": ("grew although step 6 overflowed", "expected 10 10 11 10 10  9  8  8  8",
                                 "_good_steps = 0"),
        "no_hysteresis": ("after 1 overflow in a row", "hysteresis=2 tolerates 1"),
        "clean_step_does_not_refill": ("a clean step came between the overflows", "IN A ROW"),
        "backoff_does_not_refill": ("backed off again 1 step after a back-off", "refills the hysteresis count"),
        "no_floor": ("min_scale (128)", "did not raise", "went to 64"),
        "growth_does_not_restart": ("at step 15 the scale did not grow", "start counting again from 0"),
        "skips_forever": ("max_skips = 3 skipped steps in a row", "(step 2 of xxxx); it did not raise"),
        "grows_one_step_early": ("grew after 2 clean steps in a row", "growth_interval = 3", "seen 10 11"),
        "backoff_not_assigned": ("at step 3 it did not back off", "expected 10 10 11 10; seen 10 10 11 11"),
        "counts_all_skips": ("xx.xx.xx", "must never raise", "raised FloatingPointError at step 3",
                             "skipped_in_a_row"),
        "local_verdict": ("some ranks found their gradients finite", 'op="max"'),
        "agrees_on_finite": ("applied step 1", "an inf on rank 0", "outvoted", 'op="max"'),
        "multiplies_by_scale": ("multiplied by the scale, 256", "65536 times too large", "1 / scale"),
        "not_unscaled": ("divided by 1,", "the scale, 256", "256 times too large"),
    },
    "ddp": {
        "no_divide": ("step 0, rank 0, bucket 0", "N = 2 times the mean", "expected", "seen", "divide the buffer by N"),
        "divides_twice": ("divided by N once more", "expected", "seen", "divide by N once"),
        "frees_p_grad": ("p.grad of out.bias is None after backward", "p.grad IS the parameter's slot"),
        "finish_relaunches": ("bucket 0 was launched a second time", "in _finish_backward (ddp_mistakes.py, line",
                              "from self._next on"),
        "grad_not_a_view": ("this rank's own gradient", "grad_view(i)"),
        "adds_to_old_slot": ("step 1, rank 0", "PLUS the last step's", "copied into its slot"),
        "launches_on_first_gradient": ("1 of its 2 gradients had not arrived", "self._missing[b] reaches 0"),
        "launches_when_full_in_any_order": ("bucket 1 was launched", "when bucket 0 was next", "index order"),
        "forgets_to_wait": ("bucket 4 never waited for", "self._wait_oldest()"),
        "launches_after_backward": ("nothing overlapped", "from the gradient hook"),
        "one_all_reduce_per_gradient": ("7 collectives", "(5: 50, 82, 82, 90, 118 elements)", "in one call"),
        "reduces_in_no_sync": ("inside no_sync()", "step 1's first micro-batch", "self._reducing_now"),
        "waits_in_reduce": ("waited for in _reduce", "20 autograd operations", "async_op=True"),
        "all_reduce_not_async": ("returned None", "async_op=True"),
        "all_reduce_outside_the_ledger": ("returned a Work", "self.comm"),
        "only_waits_at_the_end": ("bucket 0 never reduced", "spare", "by _finish_backward, in order"),
    },
    "zero1": {
        "all_reduces": ("all_reduce: 5 calls, 1,688 B", "expected reduce_scatter: 5 calls, 844 B"),
        "unpadded_slices": ("elements 0-40 of its 82 (81 real, 1 of padding)", "padded_numel / N = 41",
                            "PADDED"),
        "completes_into_slice_zero": ("rank 1's slice", "elements 25-50", "at elements 0-25 instead",
                                      "wrong offset", "self.shards[b]"),
        "adds_result": ("PLUS the mean", "copy it in"),
        "no_divide": ("N = 2 times the mean", "expected", "seen"),
        "no_all_gather": ("(rank 1 updates it)", "before the step", "all-gather the parameters"),
        "copied_masters": ("(rank 0 updates it)", "before the step", "a view of bucket.data"),
        "masters_in_fp64": ("is float64, shape (25,)", "trains in float32", "no cast, no copy"),
    },
    "zero2": {
        "keeps_gradient": ("3,464 B of gradients", "1,788 B in all", "p.grad = None"),
        "gives_buffer_back_early": ("bucket 0's reduce-scatter was still in flight", "self._free"),
        "accumulates_in_bf16": ("is bfloat16", "8 significant bits", "self.grad_shards[b].float()"),
        "accumulates_in_fp64": ("step 1, rank 0, bucket 0", "is float64, shape (25,)", "are float32",
                                "no .double()"),
        "unpadded_buffer": ("on 81 elements (its real elements, without the padding)",
                            "padded to 82 (1 of padding)", "[:padded_numel]"),
        "overwrites_slice": ("step 1", "the last micro-batch's gradient only", "ADD"),
        "all_reduces": ("all_reduce: 5 calls, 1,688 B", "expected reduce_scatter: 5 calls, 844 B"),
        "no_divide": ("N = 2 times the mean", "expected", "seen"),
        "keeps_pool": ("held 1,788 B of gradients", "4 Psi / N = 844 B", "self._release_pool()"),
        "waits_in_reduce": ("waited for in _reduce", "async_op=True"),
        "reduce_scatter_not_async": ("returned None", "reduce-scatter", "async_op=True"),
    },
    "zero3": {
        "prefetches_two_ahead": ("blocks.0, had not been gathered", "was for blocks.1", "order[i + 1]"),
        "prefetches_too_many": ("2 units had been gathered ahead of it (blocks.0, blocks.1)", "prefetch = 1"),
        "prefetches_itself": ("nothing had been gathered ahead", "compute waited for it"),
        "no_divide": ("unit root (rank 0's shard)", "N = 2 times the mean", "expected", "seen"),
        "shard_without_padding": ("from 82 elements into a shard of 40", "padded to 82 (1 of padding)",
                                  "not numel // N = 40", "padded_numel // N"),
        "overwrites_shard": ("step 1", "the last micro-batch's gradient only", "ADD"),
        "shard_in_fp64": ("unit root (rank 0's shard)", "is float64, shape (88,)", "are float32", "no .double()"),
        "keeps_full_gradient": ("2,532 B of gradients", "4 Psi / N = 844 B", "self.grad_full = None"),
        "keeps_memory": ("2,532 B of parameters", "4 Psi / N = 844 B", "storage_free"),
        "wait_does_not_wait": ("still in flight", "once your wait", "waited for"),
        "all_reduces": ("all_reduce: 4 calls, 1,688 B", "reduce_scatter: 4 calls, 844 B"),
        "gathers_in_place": ("unit blocks.0", "waited for in gather", "The prefetch hid nothing", "async_op=True"),
        "stale_prefetch": ("gathered blocks.1, whose backward was already done", "v.reduced"),
        "prefetch_stops_at_done": ("gathered nothing", "blocks.0, the next unit whose backward is still to run"),
        "releases_in_flight": ("freed in release", "still in flight", "waits for its handles"),
        "forgets_storage_alloc": ("into a buffer whose memory is freed (0 bytes)", "storage_alloc"),
        "gathers_into_new_buffer": ("parameters' memory still freed (0 bytes)", "wrote somewhere else",
                                    "self.full"),
        "leaves_parameters_released": ("still marked released", "mark_released with False"),
        "leaves_freed_memory_readable": ("not marked released", "mark_released with True"),
        "waits_in_reduce_scatter": ("unit blocks.2's reduce-scatter", "waited for in reduce_scatter",
                                    "self._rs"),
    },
    "views": {
        "view_copies": ("not in the memory of master 0", "a copy", ".clone()"),
        "cut_off_by_one": ("covers elements [0, 8)", "lies at [0, 9)", "one element short at its end",
                           "no - 1"),
        "cut_without_padding": ("covers elements [0, 13)", "holds its elements [0, 14)",
                                "207 real elements, padded to 208 (1 of padding)", "numel // N = 103",
                                "without the padding", "the slice you are given"),
        "views_in_fp16": ("is float16; master 0 is float32", "no .half()"),
        "flattens_whole_views": ("has shape (81,)", "own shape, (9, 9)"),
        "places_in_bucket_order": ("position 0 of parameter group 0 holds the view of side.weight",
                                   "the script put inp.weight there"),
        "skipped_gets_zero_grad": ("was given a gradient (zeros)", "no rank's backward reached side.bias",
                                   "leave their views' .grad None"),
        "empty_view_gets_grad": ("is empty (none of out.bias is on rank 0)", "an empty tensor"),
        "copies_gradients": ("the right numbers in .grad", "a copy, not a view of master 1's .grad"),
        "grads_from_the_start": ("covers elements [81, 90) of master 2", "is elements [0, 9)"),
        "slice_as_whole": ("has shape (14,)", "presented as the whole", "(9, 13)"),
        "scalars_from_own_rank": ("has no 'step'", "a plain AdamW's is 1"),
        "leaves_state_flat": ("has shape (117,)", "the parameter's, (9, 13)"),
        "assembles_from_the_start": ("element 0 of the flattened parameter", "expected", "seen",
                                     "the plain AdamW's element 14", "covers its elements [0, 14)",
                                     "each piece goes where it lies"),
        "assembles_in_fp16": ("is float16, shape (9, 13)", "a plain AdamW's is float32", "11 significant bits",
                              "Element 0 is", "dtype=piece.dtype"),
        "assembles_in_fp64": ("is float64, shape (9, 13)", "a plain AdamW's is float32", "8 bytes an element",
                              "dtype=piece.dtype"),
        "loads_whole": ("the whole of inp.weight's exp_avg, shape (9, 13)", "its view on rank 0 is (14,)"),
        "loads_from_the_start": ("holds elements [0, 103)", "covers elements [14, 117)"),
        "loads_in_fp16": ("rounded to float16", "elements [0, 14)", "element 0 is", "no .half()"),
        "loads_state_for_empty": ("none of", "is on rank", "no entry"),
    },
    "compiled": DIAGNOSES_COMPILED,     # lab 8's words live beside its own tests
}


@pytest.mark.parametrize("name, mistake", [(name, m.name) for name in LABS for m in load_lab(name).mistakes])
def test_each_planted_mistake_gets_its_own_diagnosis(reports, name, mistake):
    """A copy of the library's code with one mistake planted fails, with the failure it was planted
    for, and a report that says what was expected and what was seen in this mistake's own words,
    names the line of the graded file it comes from (here the planted mistake's module), and the
    section of the chapter to re-read."""
    report = reports[(name, "mistake", mistake)]
    first = report.first_failure
    assert first is not None, f"{mistake} passed every check:\n{report}"
    assert first.key == load_lab(name).mistake(mistake).expect, str(report)
    said = " ".join((first.line, first.where, first.hint))
    missing = [w for w in DIAGNOSES[name][mistake] if w not in said]
    assert not missing, f"{mistake}: {missing} not in\n{report}"
    module = load_lab(name).mistakes_module.rsplit(".", 1)[1]
    assert f"{module}.py, line " in said, str(report)
    assert first.section and f"Re-read: {first.section}." in str(report).replace("\n        ", " ")


def test_every_planted_mistake_has_its_words():
    planted = {(name, m.name) for name in LABS for m in load_lab(name).mistakes}
    assert planted == {(name, m) for name, words in DIAGNOSES.items() for m in words}


NUMBERS = (r"expected (\S+), seen (\S+?)[.,;]?(?:\s|$)", r"\((\S+); one process has (\S+)\)",
           r"is (\S+); one process on the global batch has (\S+) ", r"is (\S+) where (?:a plain AdamW's|the "
           r"checkpoint's) is (\S+?)\.(?:\s|$)")


def test_no_diagnosis_shows_two_different_numbers_as_the_same(reports):
    """Two numbers that differ are printed to the digit where they differ (not with :.3g, which
    shows 1.23456e-05 and 1.23457e-05 both as 1.23e-05)."""
    import re
    pairs = []
    for (name, kind, _), report in reports.items():
        if kind == "mistake":
            for pattern in NUMBERS:
                pairs += re.findall(pattern, report.first_failure.line)
    assert len(pairs) >= 15
    assert all(a != b for a, b in pairs), [p for p in pairs if p[0] == p[1]]


def test_a_state_tensor_in_another_dtype_is_told_its_dtype(reports):
    """fp16 used to be told "each piece goes where it lies" beside two numbers printed alike, and
    fp64 passed: each is now told the two dtypes, and neither where pieces go."""
    for mistake, dtype in (("assembles_in_fp16", "float16"), ("assembles_in_fp64", "float64")):
        first = reports[("views", "mistake", mistake)].first_failure
        assert f"is {dtype}" in first.line and "is float32" in first.line, first.line
        assert "where it lies" not in first.hint, first.hint


def test_a_slice_without_the_padding_is_not_told_the_off_by_ones_hint(reports):
    unpadded = reports[("views", "mistake", "cut_without_padding")].first_failure
    off_by_one = reports[("views", "mistake", "cut_off_by_one")].first_failure
    assert unpadded.key != off_by_one.key and unpadded.hint != off_by_one.hint
    assert "padding" in unpadded.line and "padding" in unpadded.hint and "padding" not in off_by_one.hint


@pytest.mark.parametrize("name", list(LABS))
def test_the_stub_files_are_wired_to_the_grader(reports, name):
    """Each untouched stub file imports, its classes are found, and the first seam the grader
    reaches is reported as still to be written, with its file and line."""
    lab = load_lab(name)
    report = reports[(name, "file", lab.stub_file)]
    first = report.first_failure
    assert first.check == "it runs" and first.key == "stub", str(report)
    assert lab.stub_file in first.line and "line" in first.line
    assert all(v.status == "----" for v in report.verdicts[1:])


def test_a_crash_names_the_rank_the_exception_and_the_students_line(reports):
    first = reports[("ddp", "file", "crashing_ddp.py")].first_failure
    assert first.key == "crash"
    assert first.line.startswith("rank 0 raised ValueError in _reduce (crashing_ddp.py, line ")
    assert "a bug in the student's _reduce" in first.line


def test_an_empty_class_is_reported_as_the_method_it_lacks_not_the_graders_placeholder(reports):
    first = reports[("ddp", "file", "empty_ddp.py")].first_failure
    assert first.key == "stub", first.line
    assert first.line.startswith("rank 0: _on_grad_ready is not written yet: MyDDP (empty_ddp.py, line 5) "
                                 "does not define it"), first.line
    assert "engine_run" not in first.line and "add a method _on_grad_ready to MyDDP" in first.hint


def test_an_error_the_library_raises_outside_the_students_methods_names_no_library_line(reports):
    """The student's _lay_out_masters returned without setting flat_masters: the AttributeError is
    raised by the library's step, where no line of the student's file runs. The report says so and
    names no file of the library (which students are not asked to read)."""
    first = reports[("zero1", "file", "no_flat_masters.py")].first_failure
    assert first.key == "crash", first.line
    assert first.line.startswith("rank 0 raised AttributeError outside your methods"), first.line
    assert "flat_masters" in first.line and ".py, line" not in first.line, first.line


@pytest.mark.parametrize("name, mistake, method", [("ddp", "waits_in_reduce", "_reduce"),
                                                  ("zero2", "waits_in_reduce", "_reduce"),
                                                  ("zero3", "gathers_in_place", "gather"),
                                                  ("zero3", "waits_in_reduce_scatter", "reduce_scatter")])
def test_a_wait_in_place_is_named_by_the_line_that_waited(reports, name, mistake, method):
    """Overlap graded as overlap: a collective waited for where it was started fails, and the
    report names the method and the very line of the wait (here in the planted mistake's module)."""
    planted = load_lab(name).mistake(mistake)
    cls = next(iter(planted.plugin.values()))
    source, start = inspect.getsourcelines(vars(cls)[method])
    line = start + next(i for i, text in enumerate(source) if ".wait()" in text)
    first = reports[(name, "mistake", mistake)].first_failure
    assert f"in {method} ({os.path.basename(inspect.getsourcefile(cls))}, line {line})" in first.line, first.line
    assert "none of them" in first.line and "async_op=True" in first.hint


def test_a_solution_written_from_lab_7s_brief_alone_passes(reports):
    """The brief (the stubs' docstrings) says enough: a solution that keeps its own bookkeeping
    (not the library's `where` and `piece`, its own format for the pieces) passes every check."""
    report = reports[("views", "file", "from_the_brief_views.py")]
    assert report.passed, str(report)


@pytest.mark.parametrize("mistake, method", [("view_copies", "_cut"), ("cut_off_by_one", "_cut"),
                                             ("places_in_bucket_order", "place"),
                                             ("skipped_gets_zero_grad", "point_grads"),
                                             ("copies_gradients", "point_grads")])
def test_lab_7_names_the_method_that_cut_placed_or_pointed(reports, mistake, method):
    first = reports[("views", "mistake", mistake)].first_failure
    assert f"your {method} (views_mistakes.py, line " in first.line, first.line
    assert first.section == 'chapter 6, "What the optimizer is handed, and what its state dict holds"'


@pytest.mark.parametrize("mistake, method", [("slice_as_whole", "assemble"), ("scalars_from_own_rank", "assemble"),
                                             ("loads_whole", "shard"), ("loads_from_the_start", "shard")])
def test_lab_7s_state_dict_failures_point_at_the_method_that_wrote_it(reports, mistake, method):
    first = reports[("views", "mistake", mistake)].first_failure
    assert f"{method} (views_mistakes.py, line " in first.hint, first.hint
    assert "param_views.py" not in first.hint + first.line      # (the library's own methods are not named)


def test_an_out_of_order_launch_is_told_to_launch_every_complete_bucket_in_order(reports):
    """Not "launch self._next, and only it", which reads as one launch per hook."""
    first = reports[("ddp", "mistake", "launches_when_full_in_any_order")].first_failure
    assert "every complete bucket from self._next on" in first.hint and "only it" not in first.hint


def test_lab_6s_helpers_are_the_labs_own_documented_names():
    from zerolab.labs import zero3
    for name in ("storage_alloc", "storage_free", "mark_released"):
        fn = getattr(zero3, name)
        assert fn.__module__ == "zerolab.labs.zero3" and fn.__name__ == name
        assert len(fn.__doc__ or "") > 200, name


def test_a_file_that_does_not_import_is_reported_without_starting_ranks(reports):
    first = reports[("ddp", "file", "broken_ddp.py")].first_failure
    assert first.key == "file" and "does not import" in first.line and "SyntaxError" in first.line


def test_a_hang_is_named_by_rank_and_operation(reports):
    report = reports[("ring", "mistake", "receives_from_the_right")]
    line = report.first_failure.line
    assert line.startswith("rank ") and " hung in receives_from_the_right " in line
    assert "'ring' did not complete within 2 s" in line and "[" not in line, line


def test_the_report_explains_the_first_failure_only(reports):
    text = str(reports[("zero1", "mistake", "no_all_gather")])
    assert text.count("What to do:") == 1 and text.count("Re-read:") == 1
    assert "The failure explained is the first thing that went wrong" in text


def test_the_labs_tolerances_are_the_parity_tests():
    """zerolab.labs.checks derives its weight tolerance as tests/tolerances.py does, from the same
    premise; and the premise holds on the lab's model: an fp32 gradient differs from an fp64 one
    by less than one AdamW step of ADAM_ROUNDOFF_STEP."""
    from zerolab.labs import checks, model
    assert checks.ADAM_ROUNDOFF_STEP == tolerances.ADAM_ROUNDOFF_STEP
    assert all(checks.weight_tol(s) == tolerances.fp32_adamw_tol(s) for s in (1, 2, 3))
    opt = model.OPTIMIZER.keywords
    assert (opt["lr"], opt["eps"]) == (tolerances.LR, tolerances.EPS)
    from zerolab.labs import views
    assert (views.LR, views.EPS) == (tolerances.LR, tolerances.EPS)
    for build in (model.build, views.build_model):      # LabNet, and lab 7's, its side block taken
        net32 = build()
        net64 = build().double()
        for step, micros in enumerate(model.SCHEDULE):
            for n in (1, 2):
                batches = [model.global_micro_batch(step, m, n) for m in range(micros)]
                g32 = model._grads(net32, batches, micros)
                g64 = model._grads(net64, [(x.double(), y.double()) for x, y in batches], micros)
                assert tolerances.adam_roundoff_step(g32, g64) < tolerances.ADAM_ROUNDOFF_STEP


BITWISE_LABS = [name for name in LABS if exact.engine_of(load_lab(name)) is not None]


def test_the_labs_with_an_exact_path():
    """Labs 3 to 6 grade a copy of zl.DDP and ZeRO-1, 2 and 3, which all have the bitwise mode."""
    assert set(BITWISE_LABS) == {"ddp", "zero1", "zero2", "zero3"}


@pytest.mark.parametrize("name", BITWISE_LABS)
def test_the_parity_checks_premise_is_exact_in_bitwise_mode(reports, name):
    """The parity check's tolerance stands for the order of addition alone: with bitwise=True the
    library's engine, on the lab's model, data and schedule (PyTorch's loop, no_sync, accumulation),
    ends every step with weights and AdamW state torch.equal to zl.SingleProcess(bitwise=True)."""
    report = reports[(name, "bitwise", None)]
    assert report.passed, str(report)
    assert [v.check for v in report.verdicts] == ["it runs", exact.EXACT]
    assert "torch.equal" in report.verdicts[1].line and "3 steps" in report.verdicts[1].line


def _exact_run(w):
    step = {"weights": {"out.bias": w}, "state": {0: {"step": torch.tensor(1.0), "exp_avg": w}}}
    return {"rank": 0, "n": 2, "engine": "zl.DDP", "steps": [step], "one": None}


def test_the_exact_check_sees_one_unit_in_the_last_place():
    """A weight one ulp away from one process's fails the exact check (where the parity check's
    tolerance would pass it), and the message names the tensor, the element and both values."""
    w = torch.linspace(-1, 1, 5)
    run = _exact_run(w.clone())
    run["one"] = [_exact_run(w.clone())["steps"][0]]
    assert "torch.equal" in exact.check([run])
    nudged = w.clone()
    nudged[3] = torch.nextafter(nudged[3], torch.tensor(2.0))
    assert float((nudged - w).abs().max()) < 1e-6          # (well inside the parity check's tolerance)
    bad = _exact_run(nudged)
    bad["one"] = run["one"]
    with pytest.raises(Wrong) as info:
        exact.check([bad])
    assert info.value.key == "not_exact" and info.value.step == 0
    assert "the weight out.bias" in info.value.what and "in 1 of its 5 elements; element 3" in info.value.what
    assert "expected 0.5, seen 0.5000001." in info.value.what, info.value.what


def test_the_command_line_lists_the_labs(capsys):
    assert labs_cli(["list"]) == 0
    out = capsys.readouterr().out
    assert all(f"labs/{load_lab(name).stub_file}" in out for name in LABS)


def test_the_command_line_refuses_an_exact_path_a_lab_lacks(capsys):
    assert labs_cli(["grade", "ring", "--bitwise"]) == 2
    assert "lab 1 has no exact path" in capsys.readouterr().err


def test_grade_refuses_an_ambiguous_call():
    from zerolab.labs import grade
    with pytest.raises(ValueError, match="give the path of your file"):
        grade("ddp", "lab3_ddp.py", reference=True)
    with pytest.raises(ValueError, match="unknown lab"):
        grade("zero4", reference=True)
    with pytest.raises(ValueError, match="give the path of your file"):
        grade("ddp", reference=True, bitwise=True)
    with pytest.raises(ValueError, match="lab 1 has no exact path: it grades no engine"):
        grade("ring", bitwise=True)
