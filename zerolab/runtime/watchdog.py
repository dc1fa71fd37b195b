"""The collective watchdog: a collective that cannot complete names the ranks that did not arrive.

zerolab.runtime.comm's Ledger runs every collective; with a timeout (the default) it uses this module:

    wait(work, timeout)                     # bounded, for every kind of work gloo and NCCL return
    mismatch_message(...)                   # a neighbour is in another collective here: stop now
    failure_message(...)                    # after it failed or ran out: who is behind, and where

Nothing is written anywhere while collectives succeed: every rank notes each collective in its
flight recorder (zerolab.runtime.recorder: a memory-mapped file, a few memory writes), and only the rank
whose collective fails or runs out reads the others' records. A peer on this machine is read from
its file, even while it is frozen (SIGSTOP, a debugger) or after it died; a peer on another
machine publishes its last records in the process group's store when its own collective fails,
and one that never does is placed by what this rank completed with it. From the records: a rank
that is behind did not arrive; a rank at the same place in another collective runs a different
sequence of collectives (and the first place where the ranks' sequences parted is named); a rank
that entered the same collective but never completed it stopped inside it. The store is asked
once, bounded, so that a store whose host froze or died is named instead of blinding the watchdog.

The timeout applies wherever torch.distributed is initialised: under zl.launch, under torchrun,
and in a process group the caller made with init_process_group. It is
$ZEROLAB_COLLECTIVE_TIMEOUT (zl.launch sets it in every rank), else DEFAULT_TIMEOUT: a run
lasts as long as it trains, and a hang is named per collective.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import math
import os
import queue
import threading
import time

import torch.distributed as dist

from .doctor import describe_parting
from .recorder import DIR_ENV, FAILED, KEPT, RECORDER, Entry, RankRecord

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
    check_timeout(seconds, f"${TIMEOUT_ENV}={value!r}", allow_none=False, where="zerolab.runtime.comm")
    return seconds


def collectives_so_far() -> int:
    """How many collectives this process has entered in this run (its flight recorder's count)."""
    return RECORDER.count


# ------------------------------------------------------------------ waiting, bounded


class _Waiter:
    """One thread for the whole process that waits on the works whose wait ignores its timeout
    (gloo's reduce-scatter and point-to-point works: no future, never is_completed()), so that
    the caller can wait for it a bounded time. A waiter left waiting when time runs out stays
    with that work (it ends with the process group's own timeout); the next wait gets a new one."""

    def __init__(self):
        self.jobs = None

    def wait(self, work, timeout: float) -> None:
        if self.jobs is None:
            self.jobs = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(self.jobs,), name="zerolab-collective-wait",
                             daemon=True).start()
        done, failed = threading.Event(), []
        self.jobs.put((work, done, failed))
        if not done.wait(timeout):
            self.jobs = None
            raise RuntimeError(f"Operation timed out! (waited {timeout:g} s)")
        if failed:
            raise failed[0]

    @staticmethod
    def _serve(jobs):
        while True:
            work, done, failed = jobs.get()
            try:
                work.wait()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                failed.append(exc)
            done.set()


_WAITER = _Waiter()


def wait(work, timeout: float) -> None:
    """work.wait(), at most `timeout` seconds; raises RuntimeError('... timed out ...') after that."""
    try:
        work.get_future()
    except RuntimeError:
        _WAITER.wait(work, timeout)
        return
    work.wait(datetime.timedelta(seconds=timeout))


# ------------------------------------------------------------------ the store, asked once


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


def _through_store(fn, seconds: float):
    """("ok", fn(store)), ("slow", None) or ("failed", the error). A store whose host is frozen
    does not answer and TCPStore's own timeout does not end a read then: the call runs on a thread
    that this one waits for a bounded time (it happens only after a collective failed)."""
    out = []

    def call():
        try:
            store = _store()
            before = store.timeout
            store.set_timeout(datetime.timedelta(seconds=seconds))
            try:
                out.append(("ok", fn(store)))
            finally:
                store.set_timeout(before)
        except Exception as exc:  # noqa: BLE001 - any failure of the store is reported
            out.append(("failed", exc))

    start = time.monotonic()
    reader = threading.Thread(target=call, daemon=True)
    reader.start()
    reader.join(seconds)
    if not out:
        return "slow", None
    if out[0][0] == "failed" and time.monotonic() - start >= 0.9 * seconds:
        return "slow", None
    return out[0]


def store_trouble(status: str, seconds: float) -> str:
    """What a store that did not answer ("slow") or failed ("failed") says about its host."""
    if status == "slow":
        return (f"the rendezvous store did not answer within {seconds:g} s: {store_host()} is frozen "
                "or unreachable")
    return f"the rendezvous store failed at once: {store_host()} is gone (killed or crashed), not another rank"


def store_said(status: str, seconds: float) -> str:
    """The store's host, named among the ranks that did not arrive, when its store did not answer."""
    host = store_host().split(" (")[0]
    if status == "slow":
        return f"{host} (frozen or gone: the store it hosts did not answer within {seconds:g} s)"
    return f"{host} (gone: {store_trouble(status, seconds)})"


def _published(entries, own: RankRecord) -> str:
    """This rank's last records, for peers on other machines (JSON)."""
    return json.dumps({"rank": own.rank, "world": own.world, "pid": own.pid, "host": own.host, "run": own.run,
                       "state": own.state, "count": own.count,
                       "entries": [list(e.__dict__.values()) for e in entries]})


def _from_published(text: bytes) -> RankRecord:
    d = json.loads(text)
    return RankRecord(d["rank"], d["world"], d["pid"], d["host"], d["run"], d["state"], d["count"],
                      [Entry(*e) for e in d["entries"]])


def _exchange(me: int, missing, seconds: float):
    """Publish this rank's last records and read those of the ranks in `missing` (peers on other
    machines), all through the store in one bounded call: (status, {rank: RankRecord}). A peer
    whose own collective fails about now publishes within a second or two: it is waited for
    that long; one that never does is waiting in no collective."""
    own = RECORDER.own()

    def talk(store):
        found = {}
        if own is not None and missing:
            store.set(f"zerolab/flight/{me}", _published(own.entries[-64:], own))
            deadline = time.monotonic() + min(2.0, seconds / 2)
            while True:
                for r in set(missing) - set(found):
                    if store.check([f"zerolab/flight/{r}"]):
                        found[r] = _from_published(store.get(f"zerolab/flight/{r}"))
                if len(found) == len(missing) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        store.check(["zerolab/record-run"])          # one read at least: does the store answer?
        return found

    status, found = _through_store(talk, seconds)
    return status, (found if status == "ok" else {})


# ------------------------------------------------------------------ naming who is behind


def _where(r: int, rec: RankRecord | None, mine: Entry, own: RankRecord | None, waited: bool):
    """("behind" | "inside" | None, words) for peer r, at this rank's collective `mine`."""
    if rec is None:
        done = [e for e in (own.entries if own else []) if e.group == mine.group and e.seq and e.seq < mine.seq]
        if not done:
            return "behind", f"rank {r} (no record of it here: on another machine, it published none)"
        return "behind", (f"rank {r} (past #{done[-1].index} {done[-1].label()}, the last collective it completed "
                          "with this rank; on another machine, it published no record: it waits in no collective)")
    theirs = rec.in_group(mine.group)
    state = rec.process()
    note = f", {state}" if state else ""
    at = theirs.get(mine.seq) if mine.seq else None
    if at is None:
        earlier = [s for s in theirs if s < mine.seq] if mine.seq else [e.index for e in rec.entries]
        if not earlier:
            return "behind", f"rank {r} (no collective yet{note})"
        last = theirs[max(earlier)] if mine.seq else rec.entries[-1]
        return "behind", f"rank {r} (last at #{last.index} {last.label()}{note})"
    if not at.same_call(mine):
        return "behind", f"rank {r} (in a different collective, #{at.index} {at.label()})"
    if waited and not at.done:
        return "inside", (f"rank {r} (entered #{at.index} {at.label()} but never completed it: frozen or "
                          f"stalled inside it{note})")
    return None, ""


def failure_message(noted, ranks, me: int, timeout: float, waited: bool) -> str:
    """The words after "<op> (collective #n of rank me) did not complete ... / failed ...":
    who did not arrive, where the ranks' sequences parted, and where the records are."""
    RECORDER.mark(FAILED)
    own = RECORDER.own()
    mine = None
    if noted is not None and own is not None:
        mine = next((e for e in reversed(own.entries) if e.index == noted[0]), None)
    if mine is None:
        return f"Ranks that did not arrive: unknown (the flight recorder is off: {DIR_ENV}=off)."
    peers = [r for r in ranks if r != me]
    records = {r: RECORDER.peer(r) for r in peers}
    wait_for = min(10.0, timeout)
    status, published = _exchange(me, [r for r in peers if records[r] is None], wait_for)
    records.update(published)
    found = {"behind": [], "inside": [], None: []}
    for r in peers:
        kind, words = _where(r, records[r], mine, own, waited)
        found[kind].append(words)
    if found["behind"]:
        who = found["behind"]
    elif found["inside"]:
        # Every other rank entered this collective, yet it did not complete: a rank that entered it
        # and then froze (SIGSTOP, a debugger) holds it. gloo and NCCL finish a collective that
        # every live rank entered, so with two ranks this names the frozen one.
        who = found["inside"]
        if len(who) > 1:
            who[-1] = who[-1][:-1] + ", one of them at least)"
    else:
        who = ["none recorded as behind (they may have failed inside it)"]
    if status != "ok":                  # the store's host first, with what its record says
        said, host = store_said(status, wait_for), store_host().split(" (")[0]
        mentioned = [w for w in who if w.startswith(host + " (")]
        who = [said[:-1] + (f"; {mentioned[0][len(host) + 2:]}" if mentioned else ")")] + \
            [w for w in who if w not in mentioned]
    parted = describe_parting({me: own, **{r: rec for r, rec in records.items() if rec is not None}}, mine.group)
    return f"Ranks that did not arrive: {', '.join(who)}." + (f" {parted}" if parted else "")


def mismatch_message(noted, clash, me: int, ranks) -> str:
    """A neighbour recorded another collective at this place of the sequence, or the one before
    (found when this rank entered it): the words of the CollectiveMismatch raised instead."""
    RECORDER.mark(FAILED)
    other, theirs = clash
    own = RECORDER.own()
    records = {me: own, **{r: RECORDER.peer(r) for r in ranks if r != me}}
    mine = next(e for e in reversed(own.entries) if e.index == noted[0])
    parted = describe_parting({r: rec for r, rec in records.items() if rec is not None}, mine.group)
    tense = "is" if theirs.seq == mine.seq else "was"      # (at the place before: found one collective late)
    return (f"{mine.label()} (collective #{mine.index} of rank {me}) does not match: rank {other} {tense} in a "
            f"different collective, #{theirs.index} {theirs.where()}. {parted} Every rank must run the same "
            "collectives in the same order; this rank stopped here rather than wait for the collective timeout "
            "or go on with tensors that do not match.")


def records_note() -> str:
    """Where this run's flight records are ("" when nowhere)."""
    d = RECORDER.run_dir
    if d:       # an error names them: kept past the newest KEEP_RUNS (recorder._prune leaves a folder with it)
        try:
            open(os.path.join(d, KEPT), "a").close()
        except OSError:
            pass
    return f" Flight records: {d} (python -m zerolab doctor {d})." if d else ""


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
