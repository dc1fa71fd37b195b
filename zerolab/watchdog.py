"""The collective watchdog: a collective that never completes names the ranks that did not arrive.

zerolab.comm's Ledger runs every collective; with a timeout (the default) it uses this module:

    seq = announce(op, tag, timeout)        # before the collective: this rank's progress in the store
    wait(work, timeout)                     # bounded, for every kind of work gloo and NCCL return
    raise timed_out(...)                    # after it: who is behind, read from the store

Every rank writes its progress (a sequence number, the op and its tag) to the process group's
key-value store before each collective, and the rank whose wait runs out reads the others'
progress: a rank that is behind did not arrive; a rank that announced the same collective but
never completed it has stopped inside it (frozen: SIGSTOP, a debugger, a machine that stopped
answering). Every store access is bounded too, so a frozen store host is named instead of
blinding the watchdog.

The timeout applies wherever torch.distributed is initialised: under zl.launch, under torchrun,
and in a process group the caller made with init_process_group. It is
$ZEROLAB_COLLECTIVE_TIMEOUT (zl.launch sets it in every rank), else DEFAULT_TIMEOUT: a run
lasts as long as it trains, and a hang is named per collective.
"""

from __future__ import annotations

import ctypes
import datetime
import math
import os
import threading
import time
import warnings

import torch.distributed as dist

TIMEOUT_ENV = "ZEROLAB_COLLECTIVE_TIMEOUT"
DEFAULT_TIMEOUT = 300.0
# A timeout must fit every clock it is handed to (timedelta, the store's and gloo's milliseconds)
# and leave the ranks time to meet at all: 1 s to about 3 years.
MIN_SECONDS, MAX_SECONDS = 1.0, 1e8


def check_timeout(value, name: str, allow_none: bool, where: str = "launch") -> None:
    """Raise ValueError unless `value` is a number of seconds in [MIN_SECONDS, MAX_SECONDS]
    (or None where allowed): 1e15 overflows a clock, 1e-9 fails the rendezvous, both deep in a rank."""
    ok = (value is None and allow_none) or (not isinstance(value, bool) and isinstance(value, (int, float))
                                            and math.isfinite(value) and MIN_SECONDS <= value <= MAX_SECONDS)
    if not ok:
        raise ValueError(f"{where + ': ' if where else ''}{name} must be a finite number of seconds > 0{' or None' if allow_none else ''}"
                         f" (at least {MIN_SECONDS:g}, at most {MAX_SECONDS:g}), got {value!r}")


def default_timeout() -> float:
    """Seconds a collective may take: $ZEROLAB_COLLECTIVE_TIMEOUT (zl.launch sets it), else 300."""
    value = os.environ.get(TIMEOUT_ENV, "").strip()
    if not value:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(value)
    except ValueError:
        seconds = None
    check_timeout(seconds, f"${TIMEOUT_ENV}={value!r}", allow_none=False, where="zerolab.comm")
    return seconds


# ------------------------------------------------------------------ who hosts the store


def store_host() -> str:
    """Who hosts the process group's store, in words, for messages that blame the right party."""
    if os.environ.get("ZEROLAB_WORKER"):
        return "rank 0 (it hosts the store under zl.launch)"
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        where = os.environ.get("MASTER_ADDR", "node 0")
        return f"torchrun's agent on {where} (it hosts the store under torchrun; no rank does)"
    return "the process that hosts the process group's store (rank 0 with init_method='env://' or 'tcp://')"


def _store():
    return dist.distributed_c10d._get_default_store()


_warned: set = set()


def store_available() -> bool:
    """Whether the default process group has a store to record progress in (MPI has none)."""
    try:
        _store()
        return True
    except Exception:  # noqa: BLE001 - any failure means: no watchdog here
        if "store" not in _warned:
            _warned.add("store")
            warnings.warn("zerolab.comm: this process group has no key-value store, so collectives are "
                          "not watched: a hang waits for the process group's own timeout.", stacklevel=4)
        return False


class _bounded:
    """Within the block, every read or write of `store` gives up after `seconds` (then restored)."""

    def __init__(self, store, seconds):
        self.store, self.seconds = store, seconds

    def __enter__(self):
        self.before = self.store.timeout
        self.store.set_timeout(datetime.timedelta(seconds=self.seconds))

    def __exit__(self, *exc):
        self.store.set_timeout(self.before)


# ------------------------------------------------------------------ before and during a collective

_progress = {"seq": 0}   # this process's count of watched collectives, across all ledgers


def collectives_so_far() -> int:
    """How many watched collectives this process has entered (every Ledger with a timeout)."""
    return _progress["seq"]


def announce(op: str, tag: str, timeout: float) -> int:
    """Record in the store that this rank enters collective #seq (op, tag); return seq."""
    _progress["seq"] += 1
    seq = _progress["seq"]
    start = time.monotonic()
    try:
        with _bounded(_store(), timeout):
            _store().set(f"zerolab/progress/{dist.get_rank()}", f"{seq}|{op}|{tag}")
    except (RuntimeError, dist.DistError) as exc:
        from .comm import CollectiveTimeout
        took = time.monotonic() - start
        how = (f"did not answer within {timeout:g} s: {store_host()} is frozen or unreachable"
               if took >= 0.9 * timeout else
               f"failed at once: {store_host()} is gone (killed or crashed), not another rank")
        raise CollectiveTimeout(f"{op}{f' {tag!r}' if tag else ''}: rank {dist.get_rank()} could not "
                                f"record its progress: the rendezvous store {how}. "
                                f"[{str(exc)[:200]}]") from None
    return seq


def wait(work, timeout: float) -> None:
    """work.wait(), at most `timeout` seconds; raises RuntimeError('... timed out ...') after that.

    gloo's reduce-scatter and point-to-point works ignore wait(timeout) (they would wait for the
    process group's own timeout, twice ours), have no future, and never report is_completed():
    those are waited for on a helper thread, which this thread waits for a bounded time. (A
    helper left waiting when time runs out ends with the process group's own timeout.)"""
    try:
        work.get_future()
        honours_timeout = True
    except RuntimeError:
        honours_timeout = False
    if honours_timeout:
        work.wait(datetime.timedelta(seconds=timeout))
        return
    done, failed = threading.Event(), []

    def wait_there():
        try:
            work.wait()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            failed.append(exc)
        finally:
            done.set()

    threading.Thread(target=wait_there, name="zerolab-collective-wait", daemon=True).start()
    if not done.wait(timeout):
        raise RuntimeError(f"Operation timed out! (waited {timeout:g} s)")
    if failed:
        raise failed[0]


# ------------------------------------------------------------------ after a collective ran out


def _quietly(fn):
    try:
        fn()
    except Exception:  # noqa: BLE001 - a store that fails is reported as not answering
        pass


def who_is_behind(ranks, me: int, seq: int, op: str, tag: str, timeout: float, waited: bool = True) -> str:
    """Read every other rank's progress and say, in words, which ranks did not arrive at
    collective #seq (op, tag) of rank `me`. waited: it ran out of time (rather than failing)."""
    store = _store()
    behind, inside = [], []
    wait_for = min(10.0, timeout)

    def label(their_op, their_tag):
        return f"{their_op}{f' {their_tag!r}' if their_tag else ''}"

    def read():
        for r in ranks:
            if r == me:
                continue
            key = f"zerolab/progress/{r}"
            if not store.check([key]):
                behind.append(f"rank {r} (no collective yet)")
                continue
            their_seq, their_op, their_tag = store.get(key).decode().split("|", 2)
            if int(their_seq) < seq:
                behind.append(f"rank {r} (last at #{their_seq} {label(their_op, their_tag)})")
            elif int(their_seq) == seq and (their_op, their_tag) != (op, tag):
                # as many collectives as this rank, but another one: the ranks' code differs
                behind.append(f"rank {r} (in a different collective, #{their_seq} {label(their_op, their_tag)})")
            else:
                inside.append(r)

    # A store whose host is frozen (SIGSTOP) does not answer, and TCPStore's own timeout
    # does not end a read then: read in a thread, and wait for it a bounded time.
    reader = threading.Thread(target=_quietly, args=(read,), daemon=True)
    reader.start()
    reader.join(wait_for)
    if reader.is_alive():
        return f"{store_host().split(' (')[0]} (frozen or gone: the store it hosts did not answer within {wait_for:g} s)"
    if behind:
        return ", ".join(behind)
    if inside and waited:
        # Every other rank entered this collective, yet it did not complete: a rank that entered it
        # and then froze (SIGSTOP, a debugger) holds it. gloo and NCCL finish a collective that
        # every live rank entered, so with two ranks this names the frozen one.
        ranks_in = ", ".join(f"rank {r}" for r in inside)
        return (f"{ranks_in} (entered #{seq} {label(op, tag)} but never completed it: frozen or stalled "
                f"inside it{'' if len(inside) == 1 else ', one of them at least'})")
    return "none recorded as behind (they may have failed inside it)"


_kept: set = set()


def keep_until_exit(group) -> None:
    """A process group whose collective failed or timed out is never destroyed by this process.

    gloo still has that collective (and any queued behind it) on its worker thread, and the
    group's destructor joins that thread: Python's exit would wait out the process group's own
    timeout for every queued collective (minutes each) before the process could end and its
    launcher could see it fail. Nothing can use the group again, so it stays alive until the
    process ends (an extra reference that nothing drops), and the exit does not wait for it."""
    for g in {group, None}:
        try:
            pg = dist.distributed_c10d._get_default_group() if g is None else g
        except Exception:  # noqa: BLE001 - no default group: nothing to keep
            continue
        if id(pg) not in _kept:
            _kept.add(id(pg))
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(pg))
