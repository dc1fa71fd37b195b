"""What a graded run plugs into the library: a student's file, the library's own code, or a
planted mistake. A plugin is a dict role -> class or function (zerolab.labs.lab.Lab.roles)."""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys


class FileProblem(Exception):
    """The student's file cannot be graded as it is (missing, does not import, no class...)."""


def for_spec(lab, spec) -> dict:
    """spec: ("reference", None) | ("mistake", name) | ("file", path) | ("bitwise", None) (nothing
    plugged in: the library's engine as it is, zerolab.labs.exact)."""
    kind, arg = spec
    if kind == "bitwise":
        return {}
    if kind == "reference":
        return dict(lab.reference)
    if kind == "mistake":
        return {**lab.reference, **lab.mistake(arg).plugin}
    if kind == "file":
        return from_file(lab, arg)
    raise ValueError(f"unknown kind of graded code {kind!r}")


def check_path(lab, path: str) -> None:
    """Raise FileProblem, in one line, unless `path` is a Python file the grader can import."""
    expected = f"the lab's file of stubs, filled in: labs/{lab.stub_file} or a copy of it"
    if os.path.isdir(path):
        raise FileProblem(f"{path} is a folder; give the .py file to grade ({expected})")
    if not os.path.isfile(path):
        raise FileProblem(f"there is no file {path} (the lab's stubs are in labs/{lab.stub_file})")
    if path.endswith(".ipynb"):
        raise FileProblem(f"{os.path.basename(path)} is a notebook; the grader grades the .py file next to it "
                          f"({expected})")
    if not path.endswith(".py"):
        raise FileProblem(f"{os.path.basename(path)} is not a Python file; the grader imports a .py file "
                          f"({expected})")


def from_file(lab, path: str) -> dict:
    """Import the student's file (by path: it need not be on sys.path) and find, for each role,
    the one class that subclasses the lab's blank (or the function of that name)."""
    check_path(lab, path)
    name = f"zerolab_lab_{lab.name}_yours"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module          # (dataclasses and pickling look their module up here)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:            # noqa: BLE001 - any error while importing is the file's
        raise FileProblem(f"{os.path.basename(path)} does not import: {type(exc).__name__}: {exc}") from None
    plugin = {}
    for role, blank in lab.roles.items():
        if blank is None:
            fn = getattr(module, role, None)
            if not callable(fn):
                raise FileProblem(f"{os.path.basename(path)} must define a function {role}(...) "
                                  f"(see labs/{lab.stub_file})")
            plugin[role] = fn
            continue
        found = [v for v in vars(module).values()
                 if isinstance(v, type) and issubclass(v, blank) and v is not blank and v.__module__ == name]
        if len(found) != 1:
            raise FileProblem(
                f"{os.path.basename(path)} must define exactly one class that subclasses "
                f"{blank.__name__} (it defines {len(found)}: "
                f"{', '.join(c.__name__ for c in found) or 'none'}); see labs/{lab.stub_file}")
        plugin[role] = found[0]
    return plugin



class GradedCode:
    """Which frames are the graded code's: every line of a student's file, and the methods (or
    functions) the plugin puts in place of the lab's blanks (a planted mistake's, and the
    library's own for the reference). A message points at such a frame, never at the grader's
    or the rest of the library's."""

    def __init__(self, lab, plugin: dict):
        library = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))     # zerolab/
        self.codes, self.files = set(), set()
        for role, obj in plugin.items():
            blank = lab.roles.get(role)
            if blank is None:
                found = [obj]
            else:
                found = []
                for cls in obj.__mro__:
                    if cls is blank or not issubclass(cls, blank):
                        break
                    found += list(vars(cls).values())
            for value in found:
                code = getattr(value, "__code__", None) or getattr(getattr(value, "__func__", None), "__code__", None)
                if code is not None:
                    self.codes.add(code)
                    if not os.path.abspath(code.co_filename).startswith(library + os.sep):
                        self.files.add(code.co_filename)

    def __contains__(self, code) -> bool:
        return code in self.codes or code.co_filename in self.files


def class_line(plugin: dict, role_class: str) -> str:
    """'MyDDP (lab3_ddp.py, line 16)': the graded class that subclasses the blank named
    role_class, where it is written ('' if none)."""
    for obj in plugin.values():
        if isinstance(obj, type) and any(c.__name__ == role_class for c in obj.__mro__[1:]):
            try:
                return f"{obj.__name__} ({os.path.basename(inspect.getsourcefile(obj))}, line " \
                       f"{inspect.getsourcelines(obj)[1]})"
            except (OSError, TypeError):
                return obj.__name__
    return ""
