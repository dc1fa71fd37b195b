"""What a graded run plugs into the library: a student's file, the library's own code, or a
planted mistake. A plugin is a dict role -> class or function (zerolab.labs.lab.Lab.roles)."""

from __future__ import annotations

import importlib.util
import os
import sys


class FileProblem(Exception):
    """The student's file cannot be graded as it is (missing, does not import, no class...)."""


def for_spec(lab, spec) -> dict:
    """spec: ("reference", None) | ("mistake", name) | ("file", path)."""
    kind, arg = spec
    if kind == "reference":
        return dict(lab.reference)
    if kind == "mistake":
        return {**lab.reference, **lab.mistake(arg).plugin}
    if kind == "file":
        return from_file(lab, arg)
    raise ValueError(f"unknown kind of graded code {kind!r}")


def from_file(lab, path: str) -> dict:
    """Import the student's file (by path: it need not be on sys.path) and find, for each role,
    the one class that subclasses the lab's blank (or the function of that name)."""
    if not os.path.isfile(path):
        raise FileProblem(f"there is no file {path!r} (the lab's stubs are in labs/{lab.stub_file})")
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

