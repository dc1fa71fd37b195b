"""zl.launch's parent side, after the ranks have started: wait for every rank's value and,
at the first failure, raise a LaunchError naming the rank that caused it.

A rank's error may only echo another rank's death (its peer closed the connection), so the
parent looks briefly for a rank that died without a word and blames that one; a rank that
returned its value meanwhile finished early, which is not a crash. A dead rank's error quotes
the end of its output (zerolab.launch.output), or the traceback it left if it failed while
starting (zerolab.launch.startup).
"""

from __future__ import annotations

import pickle
import signal
import time
from multiprocessing.connection import wait

from . import startup as launch_startup


class LaunchError(RuntimeError):
    """A worker rank raised, died, or did not finish in time."""

    quoted_output = False   # True when the message quotes the end of the failed rank's output

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _with_output(message: str, r: int, outputs, procs, private: str) -> LaunchError:
    """A LaunchError for rank r that quotes the end of its output (not shown a second time),
    or the traceback it left if it failed while starting (zerolab.launch.startup)."""
    started = launch_startup.take(private, procs[r].pid)
    if started:
        message += ("\n--- it failed while starting (before fn was called) ---\n" + started.strip() +
                    "\nA rank re-imports the script that called zl.launch and unpickles fn and args "
                    "before it runs fn: both must work in a fresh process.")
    error = LaunchError(message + outputs.tail(r), r)
    error.quoted_output = True
    return error


def _message(conn):
    """A finished rank's (status, value), or None if its pipe holds no message (poll() is also
    true at end of file)."""
    if not conn.poll():
        return None
    try:
        return pickle.loads(conn.recv_bytes())
    except EOFError:
        return None


_ECHOES = ("closed by peer", "remote worker", "Connection reset", "CollectiveError", "CollectiveTimeout")


def _is_echo(traceback_text: str) -> bool:
    """Whether a rank's error only reports another rank's absence (a peer gone, a collective
    that ran out of time), rather than a failure of its own."""
    return any(w in traceback_text for w in _ECHOES)


def _last_line(traceback_text: str) -> str:
    lines = [l for l in traceback_text.strip().splitlines() if l.strip()]
    return lines[-1] if lines else ""


def _raise_root_cause(procs, conns, outputs, private, others, grace: float, results: dict,
                      errors: dict) -> None:
    """A rank's error may only be the echo of another rank's death (its peer closed the
    connection). Look briefly for a rank that died without a word, and blame that one. A rank
    that returned its value meanwhile goes into `results` (it finished early: not a crash); a
    rank that raised too goes into `errors` (rank -> its traceback)."""
    deadline = time.monotonic() + grace
    others = set(others)
    while others:
        for q in sorted(others):
            if not conns[q].poll():      # nothing sent yet, and its pipe is still open
                continue
            others.discard(q)
            msg = _message(conns[q])
            if msg is None:              # end of file without a message: it died silently
                procs[q].join(2.0)
                raise _with_output(f"launch: rank {q} {_describe_exit(procs[q].exitcode)} before "
                                   "returning a result.", q, outputs, procs, private)
            if msg[0] == "ok":           # it returned its value: it finished early, no crash
                results[q] = msg[1]
            else:
                errors[q] = msg[1]
        if time.monotonic() >= deadline:
            return
        time.sleep(0.02)


def collect(procs, conns, outputs, private, timeout):
    """Wait for every rank's value; raise at the first failure."""
    results: dict[int, object] = {}
    pending = set(range(len(procs)))
    deadline = None if timeout is None else time.monotonic() + timeout
    while pending:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            late = sorted(pending)
            raise _with_output(
                f"launch: rank(s) {late} did not finish within the timeout of {timeout:g} s and "
                "were stopped. A rank waiting in a collective that another rank never called "
                "looks like this; so does a run that simply needs a longer timeout.", late[0], outputs, procs, private)
        watch = {}
        for r in pending:
            watch[conns[r]] = r
            watch[procs[r].sentinel] = r
        for ready in wait(list(watch), timeout=remaining):
            r = watch[ready]
            if r not in pending:
                continue
            conn = conns[r]
            if ready is conn or conn.poll():
                try:
                    status, value = pickle.loads(conn.recv_bytes())
                except EOFError:
                    procs[r].join(2.0)
                    raise _with_output(f"launch: rank {r} {_describe_exit(procs[r].exitcode)} "
                                       "before returning a result.", r, outputs, procs, private) from None
                if status == "error":
                    # an error that reports a vanished peer is worth waiting a little longer on
                    echo = any(w in value for w in _ECHOES[:3])
                    errors = {r: value}
                    _raise_root_cause(procs, conns, outputs, private, pending - {r}, 3.0 if echo else 0.5,
                                      results, errors)
                    if echo and results:
                        # nobody crashed: a rank that returned left the others in a collective
                        raise LaunchError(
                            f"launch: rank(s) {sorted(results)} finished and returned while rank {r} was "
                            "still in a collective with them: the ranks ran different numbers of steps "
                            f"or collectives (no rank crashed). Rank {r}'s error:\n{value}", r)
                    raise _several(errors, r)
                results[r] = value
                pending.discard(r)
            else:  # the process ended and sent nothing
                procs[r].join(2.0)
                raise _with_output(f"launch: rank {r} {_describe_exit(procs[r].exitcode)} "
                                   "before returning a result.", r, outputs, procs, private)
    return [results[r] for r in range(len(procs))]


def _several(errors: dict, first: int) -> LaunchError:
    """One LaunchError for every rank that raised: the traceback of the first that raised
    something of its own (not the echo of another rank's absence), then the others' errors, so
    that what each rank found is in the message whichever rank's error arrived first."""
    own = [r for r in errors if not _is_echo(errors[r])]
    main = own[0] if own else first
    message = f"launch: rank {main} raised an exception:\n{errors[main]}"
    others = [r for r in sorted(errors) if r != main and (r in own or not own)]
    for r in others:
        message += f"\n--- rank {r} raised as well ---\n{_last_line(errors[r])}"
    return LaunchError(message, main)
