"""Reading an engine as a change of the one before: the methods a class writes itself.

    from zerolab.book.source import show_changes
    show_changes(zl.ZeRO1)          # every method ZeRO1 defines, and what it overrides

Chapters 6, 7 and 8 print these so the reader sees a stage as the short diff it is.
"""

from __future__ import annotations

import inspect
import textwrap


def own_methods(cls) -> list:
    """(name, function) of every method and property `cls` defines in its own body, in order."""
    out = []
    for name, value in vars(cls).items():
        fn = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
        if inspect.isfunction(fn):
            out.append((name, fn))
    return out


def changes(cls) -> dict:
    """{"base": the class it extends, "methods": [(name, overrides?, lines)], "lines": total}."""
    base = cls.__mro__[1]
    rows = [(name, hasattr(base, name), len(inspect.getsource(fn).splitlines()))
            for name, fn in own_methods(cls)]
    return {"base": base.__name__, "methods": rows, "lines": sum(n for _, _, n in rows)}


def show_changes(cls, names=None, summary=True) -> None:
    """Print the source of the methods `cls` writes itself (or only `names`), then a summary line."""
    for name, fn in own_methods(cls):
        if names is None or name in names:
            print(textwrap.dedent(inspect.getsource(fn)))
    if not summary:
        return
    c = changes(cls)
    new = [n for n, over, _ in c["methods"] if not over]
    print(f"{cls.__name__}({c['base']}): {len(c['methods'])} methods, {c['lines']} lines; "
          f"{len(c['methods']) - len(new)} replace one of {c['base']}'s, {len(new)} are new"
          + (f" ({', '.join(new)})" if new else ""))
