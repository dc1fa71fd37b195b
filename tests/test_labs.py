"""The labs' graders, graded: each passes the library's own engine and fails every planted mistake
with the failure it was planted for, and its own message.

Everything below is graded in ONE run (zerolab.labs.grade_cases: one launch per world size, the
cases in turn in the same ranks), because starting ranks that build an engine costs seconds:
every lab's reference, every planted mistake, the untouched stub files of labs/, and two student
files written here (one that crashes, one that does not import). The tests read its reports.
"""

import inspect
import os
import textwrap

import pytest

import tolerances
from zerolab.labs import LABS, grade_cases
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


def test_the_command_line_lists_the_labs(capsys):
    assert labs_cli(["list"]) == 0
    out = capsys.readouterr().out
    assert all(f"labs/{load_lab(name).stub_file}" in out for name in LABS)


def test_grade_refuses_an_ambiguous_call():
    from zerolab.labs import grade
    with pytest.raises(ValueError, match="give the path of your file"):
        grade("ddp", "lab3_ddp.py", reference=True)
    with pytest.raises(ValueError, match="unknown lab"):
        grade("zero4", reference=True)
