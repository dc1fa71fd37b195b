"""Grading, the parent's side: launch the ranks, read what they measured, run the checks in
order, and explain the first thing wrong.

    grade("ddp", "lab3_ddp.py")            # a student's file
    grade("ddp", reference=True)           # the library's own code (the solution)
    grade("ddp", mistake="no_divide")      # a planted mistake
    grade("ddp", bitwise=True)             # the library's engine, bitwise=True, against one process, torch.equal
    grade_many("ddp", specs)               # several, in one launch
    grade_cases([("ddp", spec), ...])      # several labs' cases, one launch per world size (the tests)
"""

from __future__ import annotations

import os
import textwrap
from dataclasses import dataclass, field

from ..launch import launch
from ..launch import LaunchError
from . import exact
from .lab import Wrong
from .overlap import defined_at
from .plugins import FileProblem, for_spec
from .worker import load_lab, run_cases

COLLECTIVE_TIMEOUT = 5.0    # seconds a collective may wait before the watchdog names a hang
HANG_TIMEOUT = 2.0          # for a planted mistake known to hang
LAUNCH_TIMEOUT = 120.0      # the whole grading, if graded code loops without communicating


@dataclass
class Verdict:
    check: str
    status: str                 # "PASS" | "FAIL" | "----" (not checked)
    line: str = ""              # what passed, or what went wrong in one line
    hint: str = ""
    section: str = ""
    key: str = ""               # the kind of failure (tests)
    step: int | None = None     # the training step the failure was seen at (None: not tied to one)
    where: str = ""             # the graded code it comes from: "your _reduce (lab3_ddp.py, line 40)"
    blame: tuple = ()           # the seams the check named (else the lab's blame for the key)


@dataclass
class Report:
    lab: object
    graded: str                 # what was graded, in words
    verdicts: list = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.verdicts) and all(v.status == "PASS" for v in self.verdicts)

    @property
    def first_failure(self) -> Verdict | None:
        """The first thing wrong: the failure seen at the earliest step of the run, and among those
        the first in the lab's order of checks (a failure not tied to a step comes after them)."""
        failed = [(float("inf") if v.step is None else v.step, i)
                  for i, v in enumerate(self.verdicts) if v.status == "FAIL"]
        return self.verdicts[min(failed)[1]] if failed else None

    def __str__(self) -> str:
        lab = self.lab
        out = [f"Lab {lab.number}, {lab.title}: {self.graded}, on {lab.world_size} ranks"]
        first = self.first_failure
        for v in self.verdicts:
            out.append(f"  {v.status}  {v.check}" + (f": {v.line}" if v.line and v is not first else ""))
            if v is first:
                out += _indent(v.line, 8)
                if v.where:
                    out += _indent(f"Look at: {v.where}.", 8)
                if v.hint:
                    out += _indent(f"What to do: {v.hint}", 8)
                out += _indent(f"Re-read: {v.section}.", 8)
        if first is None:
            out.append("  Every check passed.")
        elif sum(v.status == "FAIL" for v in self.verdicts) > 1:
            out.append("  The failure explained is the first thing that went wrong in the run: fix it first, "
                       "the others often follow from it.")
        return "\n".join(out)


def _indent(text: str, n: int) -> list:
    return textwrap.wrap(text, width=100, initial_indent=" " * n, subsequent_indent=" " * n)


def grade(name: str, path: str | None = None, *, reference: bool = False, mistake: str | None = None,
          bitwise: bool = False, show: bool = True) -> Report:
    """Grade lab `name`: the student's file at `path`, or the library's own code (reference=True),
    or a planted mistake; or (bitwise=True) show the parity check's premise exact: the library's
    engine with bitwise=True against one process, torch.equal (zerolab.labs.exact). Prints the
    report (show=False: only returns it)."""
    lab = load_lab(name)
    if sum((path is not None, reference, mistake is not None, bitwise)) != 1:
        raise ValueError(f"grade({name!r}, ...): give the path of your file (labs/{lab.stub_file}), "
                         "or reference=True, or mistake=NAME, or bitwise=True")
    if bitwise and exact.engine_of(lab) is None:
        raise ValueError(f"grade({name!r}, bitwise=True): lab {lab.number} has no exact path: {exact.no_path(lab)}")
    spec = ("reference", None) if reference else ("mistake", mistake) if mistake else ("bitwise", None) if bitwise \
        else ("file", os.path.abspath(path))
    report = grade_many(name, [spec])[0]
    if show:
        print(report)
    return report


def describe_spec(lab, spec) -> str:
    kind, arg = spec
    if kind == "reference":
        return "the library's own code (the solution)"
    if kind == "mistake":
        return f"planted mistake {arg!r} ({lab.mistake(arg).story})"
    if kind == "bitwise":
        return f"the library's engine ({exact.NAMES[lab.engine]}) with bitwise=True, against one process"
    return f"grading {os.path.basename(arg)}"


def grade_many(name: str, specs: list) -> list:
    """Grade several specs of one lab in ONE launch (each in turn, in the same ranks): a Report each."""
    return grade_cases([(name, spec) for spec in specs])


def grade_cases(cases: list) -> list:
    """Grade (lab name, spec) cases, one launch per world size: a Report each, in order. Cases in
    one launch run in turn in the same ranks; planted mistakes that hang go last, with a short
    collective timeout."""
    labs = {name: load_lab(name) for name, _ in cases}
    reports = [Report(labs[name], describe_spec(labs[name], spec)) for name, spec in cases]
    runnable, plugins = [], {}
    for report, (name, spec) in zip(reports, cases):
        try:
            # a file that does not import is reported without starting ranks
            plugins[(name, spec)] = for_spec(labs[name], spec)
            runnable.append((name, spec))
        except FileProblem as exc:
            report.verdicts = [Verdict("it runs", "FAIL", str(exc), "", "the lab's brief", "file")]
    results = {}
    for size in sorted({labs[name].world_size for name, _ in runnable}):
        group = [c for c in runnable if labs[c[0]].world_size == size]
        hangs = [c for c in group if c[1][0] == "mistake" and labs[c[0]].mistake(c[1][1]).hangs]
        order = [c for c in group if c not in hangs] + hangs
        timeouts = [HANG_TIMEOUT if c in hangs else COLLECTIVE_TIMEOUT for c in order]
        try:
            per_rank = launch(run_cases, size, args=(order, timeouts), timeout=LAUNCH_TIMEOUT,
                              collective_timeout=COLLECTIVE_TIMEOUT)
            results.update({c: [rank[i] for rank in per_rank] for i, c in enumerate(order)})
        except LaunchError as exc:
            results.update({c: [{"data": None, "error": {"launch": str(exc)}}] * size for c in order})
    for report, case in zip(reports, cases):
        if case in results:
            checks = exact.CHECKS if case[1][0] == "bitwise" else None
            report.verdicts = evaluate(labs[case[0]], results[case], plugins.get(case), checks)
    return reports


# ------------------------------------------------------------------ from measurements to verdicts


def evaluate(lab, ranks: list, plugin: dict | None = None, checks=None) -> list:
    """The verdicts of one graded run, from every rank's result, in the lab's order (or `checks`'
    order: the exact path's); each failure names the graded code it comes from (written_in), given
    the plugin that was graded."""
    verdicts = _evaluate(lab, ranks, lab.checks if checks is None else checks)
    if plugin:
        for v in verdicts:
            if v.status == "FAIL":
                v.where = written_in(lab, plugin, v)
    return verdicts


def written_in(lab, plugin: dict, verdict) -> str:
    """'your _reduce (lab3_ddp.py, line 40)' for each seam a failure of this kind comes from
    (Lab.blame, or the Wrong's own), that the graded code writes itself (not the library's own
    method, which a planted mistake keeps) and that the message does not name already."""
    found = []
    for seam in verdict.blame or lab.blame.get(verdict.key, ()):
        fn, library = _seam(lab, plugin, seam)
        if fn is None or getattr(fn, "__code__", None) is getattr(library, "__code__", False):
            continue
        at = defined_at(fn)
        said = verdict.line + verdict.hint
        if at and at.strip() not in said and f"{seam} (" not in said:
            found.append(f"your {seam}{at}")
    return " and ".join(found)


def _seam(lab, plugin: dict, name: str) -> tuple:
    """(the graded code's seam `name`, the library's own), a method of a role's class or a function role."""
    for role, blank in lab.roles.items():
        if blank is None and role == name:
            return plugin.get(role), lab.reference[role]
        if blank is not None and name in dir(blank) and role in plugin:
            return getattr(plugin[role], name, None), getattr(lab.reference[role], name, None)
    return None, None


def _evaluate(lab, ranks: list, checks) -> list:
    failure = _run_failure(ranks)
    if failure is not None:                       # it crashed, hung, or never started
        key, line, hint = failure
        return [Verdict("it runs", "FAIL", line, hint, "the lab's brief, and the stubs' docstrings", key)] + \
               [Verdict(c.title, "----", "not checked: the run did not finish") for c in checks]
    stop = _first_stop(checks, ranks)
    verdicts = [Verdict("it runs", "PASS", "no error and no hang on any rank" if stop is None else
                        "no error and no hang, until the grader stopped the run (below)")]
    stopped = False
    for check in checks:
        if stop is not None and check.title == stop[0]:
            _, key, what, hint = stop
            verdicts.append(Verdict(check.title, "FAIL", what, hint, check.section, key))
            stopped = True
        elif stopped or (stop is not None and check.run is not None):
            verdicts.append(Verdict(check.title, "----", "not checked: the run was stopped"))
        elif check.run is None:                   # made during the run, and nothing was wrong
            verdicts.append(Verdict(check.title, "PASS", check.passed))
        else:
            verdicts.append(_after_run(check, [r["data"] for r in ranks]))
    return verdicts


def _first_stop(checks, ranks: list):
    """The Stop raised on some rank for the earliest check in the lab's order, or None."""
    titles = [c.title for c in checks]
    stops = [r["error"]["stop"] for r in ranks if r["error"] and "stop" in r["error"]]
    return min(stops, key=lambda s: titles.index(s[0])) if stops else None


def _after_run(check, data: list) -> Verdict:
    try:
        return Verdict(check.title, "PASS", check.run(data))
    except Wrong as exc:
        return Verdict(check.title, "FAIL", exc.what, exc.hint, check.section, exc.key, exc.step, blame=exc.blame)
    except Exception as exc:    # noqa: BLE001 - a run the check cannot read fails the check
        return Verdict(check.title, "FAIL", f"the grader could not read the run: {type(exc).__name__}: {exc}",
                       "", check.section, "unreadable")


def _run_failure(ranks: list):
    """(key, line, hint) if the run crashed or hung on some rank, else None. The root cause is a
    rank's own error, or else a rank's timeout; a closed connection is only their echo."""
    errors = [(r, res["error"]) for r, res in enumerate(ranks) if res["error"] and "stop" not in res["error"]]
    if any(res.get("not_run") for res in ranks):
        return ("not_run", "not run: the ranks were out of step after an earlier case", "")
    stopped = any(res["error"] and "stop" in res["error"] for res in ranks)
    if not errors or (stopped and all(e.get("hang") or e.get("peer_left") for _, e in errors)):
        return None             # (a rank the grader stopped leaves its peers waiting: the Stop explains it)
    for r, e in errors:
        if "launch" in e:
            return ("crash", e["launch"], "")
        if "file" in e:
            return ("file", e["file"], "")
    # a rank's own error first; then a rank that timed out (the hang itself: when its wait ends,
    # gloo closes the connection, and the ranks waiting on it see "a peer left" instead)
    own = [(r, e) for r, e in errors if not e["hang"] and not e["peer_left"]]
    hung = [(r, e) for r, e in errors if e["hang"]]
    r, e = (own or hung or errors)[0]
    where = f" in {e['where']}" if e["where"] else ""
    if e.get("unwritten"):
        method, cls = e["unwritten"]
        return ("stub", f"rank {r}: {method} is not written yet: {cls or 'your class'} does not define it, "
                        f"so the lab's blank {method} ran (it raises NotImplementedError).",
                f"add a method {method} to {cls.split(' (')[0] or 'your class'}, as the stub file's docstring for it says.")
    if e["stub"]:
        return ("stub", f"rank {r}: {e['where'] or 'a seam'} is still a stub (it raises NotImplementedError).",
                "write it, as its docstring says.")
    if e["hang"]:
        return ("hang", f"rank {r} hung{where}: {e['message']}",
                "every rank must issue the same collectives (and sends and receives) in the same "
                "order; a rank that waits for a message nobody sends hangs.")
    if not e["where"]:
        return ("crash", f"rank {r} raised {e['type']} outside your methods, in the library as it used what "
                         f"they had left: {e['message']}",
                "none of your lines was running when it was raised: the library failed on something your "
                "methods left, or did not set; compare what each leaves with its docstring.")
    return ("crash", f"rank {r} raised {e['type']}{where}: {e['message']}",
            "look at the line it names; the stubs' docstrings say what each method is given and must leave.")
