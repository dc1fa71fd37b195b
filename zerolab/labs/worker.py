"""What every rank runs when a lab is graded: each case in turn, in the same ranks.

A case is the code to grade (a student's file, the library's own code, a planted mistake). Its
run is measured by the lab (Lab.measure) and whatever it raises is turned into a description the
parent can print: the rank, the exception, where in the graded code it was raised, and whether it
was a collective that timed out (a hang, named by zerolab.runtime.comm's watchdog with the operation and
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

from ..runtime import comm, watchdog
from . import exact
from .engine_run import StubCalled
from .lab import LABS, Stop
from .plugins import FileProblem, GradedCode, class_line, for_spec


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
        plugin = None
        try:
            plugin = for_spec(lab, spec)
            data = exact.measure(lab) if spec[0] == "bitwise" else lab.measure(plugin)
            results.append({"data": data, "error": None})
        except Exception as exc:    # noqa: BLE001 - everything the graded code raises is reported
            results.append({"data": None, "error": describe(exc, lab, plugin)})
        if not _still_in_step(i, timeout):
            results += [{"data": None, "error": None, "not_run": True}] * (len(cases) - i - 1)
            break
    return results


def describe(exc: BaseException, lab, plugin: dict | None) -> dict:
    """What the parent needs to explain a failure: the exception, and where in the GRADED code
    (the student's file, or a planted mistake) it was raised; never a line of the grader's or
    the library's own, which the student did not write."""
    if isinstance(exc, Stop):
        return {"stop": (exc.check, exc.key, exc.what, exc.hint)}
    if isinstance(exc, FileProblem):
        return {"file": str(exc)}
    message = str(exc).strip()
    if isinstance(exc, comm.CollectiveError):
        # the watchdog's words without the process-wide collective count and the backend's own text
        message = re.sub(r" \(collective #\d+ of rank \d+\)", "", message)
        message = re.sub(r" \[.*\]$", "", message, flags=re.S)
    graded = GradedCode(lab, plugin) if plugin else None
    frames = [(f.f_code, line) for f, line in traceback.walk_tb(exc.__traceback__)
              if graded is not None and f.f_code in graded]
    where = None if not frames else \
        f"{frames[-1][0].co_name} ({os.path.basename(frames[-1][0].co_filename)}, line {frames[-1][1]})"
    unwritten = None
    if isinstance(exc, StubCalled):     # the student's class does not define this seam at all
        unwritten = (exc.method, class_line(plugin or {}, exc.role_class))
    return {"type": type(exc).__name__, "message": message, "where": where, "unwritten": unwritten,
            "stub": isinstance(exc, NotImplementedError),
            "hang": isinstance(exc, comm.CollectiveTimeout),
            "peer_left": isinstance(exc, comm.CollectiveError) and not isinstance(exc, comm.CollectiveTimeout)}


def _still_in_step(case: int, timeout: float) -> bool:
    """Meet the other ranks through the store; True if every rank issued as many collectives.

    (zerolab.runtime.watchdog counts every collective a Ledger with a timeout announces, in this process.)
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
