"""What a lab is made of, and the two ways a check says something is wrong.

A Lab names its seams (the methods or functions a student writes, each a `role` with the class
the student subclasses), the library's own code for each (the reference: the solution), how one
graded run is measured on every rank (`measure`), its checks in order, and its planted mistakes.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

# the labs, in the book's order: name (for `python -m zerolab.labs grade NAME`) -> module of zerolab.labs
LABS = {"ring": "ring", "scaler": "scaler", "ddp": "ddp", "zero1": "zero1", "zero2": "zero2", "zero3": "zero3",
        "views": "views", "compiled": "compiled"}


class Wrong(Exception):
    """A check found something wrong. `key` names the kind of mistake (the tests read it), `what`
    says what was expected and what was seen (which rank, bucket or unit, which step), `hint` what
    to do about it."""

    def __init__(self, key: str, what: str, hint: str = "", step: int | None = None, blame: tuple = ()):
        super().__init__(what)
        self.key, self.what, self.hint = key, what, hint
        self.step = step        # the training step it was seen at (None: not tied to one)
        self.blame = blame      # the seams it comes from, if not the lab's blame for its key


class Stop(Wrong):
    """Raised DURING a run by the grader's own instruments, the moment the protocol a chapter
    describes is broken (a bucket reduced before it is full, a buffer reused while in flight...):
    what happens next would depend on timing, so the run stops there. `check` is the title of the
    check it belongs to."""

    def __init__(self, check: str, key: str, what: str, hint: str = ""):
        super().__init__(key, what, hint)
        self.check = check      # (a Stop ends the run: nothing after it is measured)


@dataclass(frozen=True)
class Check:
    """One check: `run(ranks)` reads the measured data of every rank (a list, in rank order) and
    returns one line saying what passed, or raises Wrong. `section` is where to re-read."""

    title: str
    run: Callable | None        # None: a check made during the run (Stop), nothing left to read after
    section: str
    passed: str = ""            # the line shown when a check made during the run saw nothing wrong


@dataclass(frozen=True)
class Mistake:
    """A mistake students make, planted in the library's code: `plugin` replaces one or more
    roles; the grader must fail it with the failure `expect` (a Wrong key)."""

    name: str
    story: str                  # what the student did, in one line
    plugin: dict
    expect: str
    hangs: bool = False         # it hangs: graded last, with a short collective timeout


@dataclass(frozen=True)
class Lab:
    name: str                   # for `python -m zerolab.labs grade NAME`
    number: int
    title: str
    chapter: str                # the chapter it practises, as the book names it
    stub_file: str              # the file of stubs in labs/
    world_size: int
    roles: dict                 # role -> the class a student's class subclasses (None: a function)
    reference: dict             # role -> the library's own code: the solution
    measure: Callable           # plugin -> data, on every rank (zerolab.labs.worker)
    checks: tuple
    mistakes_module: str = ""   # the module whose MISTAKES are this lab's planted mistakes
    # a Wrong key -> the seams (method or function names) whose code a failure of that kind comes
    # from: the report names their lines in the graded file (zerolab.labs.runner.written_in)
    blame: dict = field(default_factory=dict)
    # the library engine (a zerolab.engines.make name) the graded engine is a copy of: if it has a
    # bitwise mode, grade(name, bitwise=True) shows the parity check's premise exact (zerolab.labs.exact)
    engine: str = ""

    @property
    def mistakes(self) -> tuple:
        return importlib.import_module(self.mistakes_module).MISTAKES if self.mistakes_module else ()

    def mistake(self, name: str) -> Mistake:
        for m in self.mistakes:
            if m.name == name:
                return m
        raise ValueError(f"lab {self.name!r} has no planted mistake {name!r}; it has "
                         f"{', '.join(m.name for m in self.mistakes)}")
