"""What launched workers print, and how zl.launch shows it.

Each rank of zl.launch writes its stdout and its stderr to two files of its own (rank{r}.out,
rank{r}.err). The redirection is os.dup2 on file descriptors 1 and 2, so output of C and C++
code (a torch warning from C++, os.write(1, ...)) is captured as well as Python's print and
warnings.warn.

When the launch ends, the parent shows that output in rank order, each line prefixed
`[rank r] `: a rank's stdout to the caller's sys.stdout, then its stderr to sys.stderr (so
Jupyter shows them in its usual streams). Which ranks and streams are shown is the `output`
choice:

    "rank0"  rank 0's stdout and stderr, and the stderr (warnings, errors) of every other rank
    "all"    every rank's stdout and stderr
    "none"   nothing

Why at the end, and why two files rather than one interleaved stream: the ranks run at the
same time, so showing their lines as they come would mix them differently on every run, and a
notebook's committed output must be the same each time. Within one rank the order of stdout
against stderr cannot be recovered reliably either (Python buffers a redirected stdout, while
C++ writes to stderr at once), and keeping the streams apart is what lets "rank0" show only
the other ranks' warnings and lets stderr land in sys.stderr. So: rank by rank, stdout then
stderr, each in its own order.
"""

from __future__ import annotations

import ctypes
import os
import sys

CHOICES = ("rank0", "all", "none")
ENV = "ZEROLAB_LAUNCH_OUTPUT"   # the default when launch(..., output=None)


def resolve(output: str | None) -> str:
    """The output choice in force: the keyword if given, else $ZEROLAB_LAUNCH_OUTPUT, else "rank0"."""
    listed = ", ".join(repr(c) for c in CHOICES)
    if output is None:
        env = os.environ.get(ENV, "").strip()
        if not env:
            return "rank0"
        if env not in CHOICES:
            raise ValueError(f"launch: the environment variable {ENV}={env!r} must be one of {listed}")
        return env
    if output not in CHOICES:
        raise ValueError(f"launch: output must be one of {listed} (rank 0's output and the other "
                         f"ranks' stderr / every rank's output / nothing), got {output!r}")
    return output


def paths(logdir: str, rank: int) -> tuple[str, str]:
    """The files that hold rank `rank`'s stdout and stderr."""
    return os.path.join(logdir, f"rank{rank}.out"), os.path.join(logdir, f"rank{rank}.err")


# --------------------------------------------------------------------- in the worker


def redirect(out_path: str, err_path: str) -> None:
    """Send this process's file descriptors 1 and 2 (Python's and C's output) to the two files."""
    flush()
    for fd, path in ((1, out_path), (2, err_path)):
        new = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(new, fd)
        os.close(new)
    if sys.stdout is not None and hasattr(sys.stdout, "reconfigure"):
        # line by line: a rank that dies mid-run (a signal, os._exit) still leaves what it printed
        sys.stdout.reconfigure(line_buffering=True)


def flush() -> None:
    """Write out what Python and the C library still hold (the worker ends with os._exit)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # noqa: BLE001 - a closed or odd stream must not hide the result
            pass
    try:
        ctypes.CDLL(None).fflush(None)   # C stdio buffers: printf from C/C++ code
    except Exception:  # noqa: BLE001 - not every platform exposes libc this way
        pass


# --------------------------------------------------------------------- in the parent


def read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace", newline="") as f:
            return f.read()
    except OSError:
        return ""


def prefixed(text: str, rank: int) -> str:
    """Every line of `text` prefixed `[rank r] `; a last line without a newline is kept, nothing
    else is stripped; empty text stays empty."""
    if not text:
        return ""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return "".join(f"[rank {rank}] {line}\n" for line in lines)


def show(logs: list[tuple[str, str]], mode: str, skip: int | None = None) -> None:
    """Write the ranks' output to sys.stdout / sys.stderr in rank order, as `mode` selects.

    `skip`: a rank whose output is already in the error being raised (its tail), not shown twice.
    """
    if mode == "none":
        return
    for r, (out_path, err_path) in enumerate(logs):
        if r == skip:
            continue
        streams = [(err_path, sys.stderr)]
        if mode == "all" or r == 0:
            streams.insert(0, (out_path, sys.stdout))
        for path, stream in streams:
            text = prefixed(read(path), r)
            if text and stream is not None:
                stream.write(text)
                stream.flush()   # stdout before stderr, in a terminal too


def tail(out_path: str, err_path: str, limit: int = 3000) -> str:
    """The end of a failed rank's output for an error message: its stderr (tracebacks, C++
    errors) first in importance, then as much of its stdout's end as leaves room (at least a
    few lines). Empty when the rank wrote nothing."""
    err = _last(read(err_path).strip(), limit)
    out = _last(read(out_path).strip(), max(limit - len(err), 1000))
    text = ""
    if out:
        text += "\n--- its stdout (last lines) ---\n" + out
    if err:
        text += "\n--- its stderr (last lines) ---\n" + err
    return text


def _last(text: str, limit: int) -> str:
    """The last `limit` characters of text, starting at a line boundary when cut."""
    if len(text) <= limit:
        return text
    cut = text[-limit:]
    newline = cut.find("\n")
    return cut[newline + 1:] if 0 <= newline < len(cut) - 1 else cut
