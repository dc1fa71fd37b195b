"""What every rank runs when a lab is graded: each case in turn, in the same ranks.

A case is the code to grade (a student's file, the library's own code, a planted mistake). Its
run is measured by the lab (Lab.measure) and whatever it raises is turned into a description the
parent can print: the rank, the exception, where in the graded code it was raised, and whether it
was a collective that timed out (a hang, named by zerolab.comm's watchdog with the operation and
the ranks that did not arrive).

After each case the ranks meet through the rendezvous store (not a collective, which a failed
case may have left unmatched) and compare how many collectives each has issued. Equal counts
mean they are still in step and the next case can run; otherwise the cases left are not run.
"""

from __future__ import annotations

import datetime
import importlib
import os
import re
import traceback

import torch
import torch.distributed as dist

from .. import comm, watchdog
from .lab import LABS, Stop
from .plugins import FileProblem, for_spec


def load_lab(name: str):
    """The Lab of that name (zerolab.labs.<module>.LAB)."""
    if name not in LABS:
        raise ValueError(f"unknown lab {name!r}; the labs are {', '.join(LABS)}")
    return importlib.import_module(f"zerolab.labs.{LABS[name]}").LAB


def run_cases(cases: list, timeouts: list) -> list:
    """On every rank: grade each case, a (lab name, spec), in turn; one result dict per case."""
    torch.set_num_threads(1)
    results = []
    for i, ((lab_name, spec), timeout) in enumerate(zip(cases, timeouts)):
        lab = load_lab(lab_name)
        os.environ[comm.TIMEOUT_ENV] = f"{timeout:g}"      # Ledgers made from now on wait this long
        path = spec[1] if spec[0] == "file" else None
        try:
            results.append({"data": lab.measure(for_spec(lab, spec)), "error": None})
        except Exception as exc:    # noqa: BLE001 - everything the graded code raises is reported
            results.append({"data": None, "error": describe(exc, path)})
        if not _still_in_step(i, timeout):
            results += [{"data": None, "error": None, "not_run": True}] * (len(cases) - i - 1)
            break
    return results


def describe(exc: BaseException, path: str | None) -> dict:
    """What the parent needs to explain a failure."""
    if isinstance(exc, Stop):
        return {"stop": (exc.check, exc.key, exc.what, exc.hint)}
    if isinstance(exc, FileProblem):
        return {"file": str(exc)}
    frame = _blame(exc, path)
    message = str(exc).strip()
    if isinstance(exc, comm.CollectiveError):
        # the watchdog's words without the process-wide collective count and the backend's own text
        message = re.sub(r" \(collective #\d+ of rank \d+\)", "", message)
        message = re.sub(r" \[.*\]$", "", message, flags=re.S)
    return {"type": type(exc).__name__, "message": message,
            "where": None if frame is None else f"{frame.name} ({os.path.basename(frame.filename)}, "
                                                  f"line {frame.lineno})",
            "stub": isinstance(exc, NotImplementedError),
            "hang": isinstance(exc, comm.CollectiveTimeout),
            "peer_left": isinstance(exc, comm.CollectiveError) and not isinstance(exc, comm.CollectiveTimeout)}


def _blame(exc, path):
    """The innermost frame in the graded code: the student's file, else a planted mistake's
    module, else the innermost frame of all."""
    frames = traceback.extract_tb(exc.__traceback__)
    in_file = [f for f in frames if path is not None and os.path.abspath(f.filename) == path]
    planted = [f for f in frames if f.filename.endswith("_mistakes.py")]
    return (in_file or planted or frames or [None])[-1]


def _still_in_step(case: int, timeout: float) -> bool:
    """Meet the other ranks through the store; True if every rank issued as many collectives.

    (zerolab.watchdog counts every collective a Ledger with a timeout announces, in this process.)
    """
    if dist.get_world_size() == 1:
        return True
    store = dist.distributed_c10d._get_default_store()
    store.set(f"zerolab/labs/{case}/{dist.get_rank()}", str(watchdog.collectives_so_far()))
    keys = [f"zerolab/labs/{case}/{r}" for r in range(dist.get_world_size())]
    before = store.timeout
    store.set_timeout(datetime.timedelta(seconds=3 * timeout + 10))
    try:
        store.wait(keys)
        counts = {store.get(k) for k in keys}
    finally:
        store.set_timeout(before)
    return len(counts) == 1
