"""Fold the chapter runs (gpu.run_chapter JSON files) and a pytest log into one small JSON.

    python -m gpu.summarize_runs OUT.json RUN_DIR [RUN_DIR ...]

A later RUN_DIR's chapter replaces an earlier one's (a re-run after a fix); the earlier
result is kept under "earlier" so the failure that was fixed stays on record. An OUT.json that
exists already keeps its chapters and runs: the new ones are added to it (a later machine start
that ran only some chapters).
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys

from gpu.common import write_json


def pytest_summary(path):
    if not os.path.exists(path):
        return None
    text = open(path).read()
    last = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed)", ln)]
    bad = set(re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.M))
    # pytest -v under xdist prints each result as it comes ("[gw2] [ 45%] FAILED tests/..."):
    # a run cut short by its time limit still says which tests passed and failed
    verbose = re.findall(r"^\[gw\d+\] \[\s*\d+%\] (PASSED|FAILED|ERROR|SKIPPED) (\S+)", text, re.M)
    bad |= {name for outcome, name in verbose if outcome in ("FAILED", "ERROR")}
    out = {"summary": last[-1].strip("= ") if last else None, "failed_or_error": sorted(bad)}
    if not last and verbose:
        counts = {k: sum(1 for o, _ in verbose if o == k) for k in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
        out["summary"] = (f"cut short by its time limit: {counts['PASSED']} passed, {counts['FAILED']} failed, "
                          f"{counts['ERROR']} errors, {counts['SKIPPED']} skipped before it was stopped "
                          "(the failures' messages were not printed)")
    return out


def main(out, dirs):
    before = json.load(open(out)) if os.path.exists(out) else {}
    chapters, pytests = before.get("chapters", {}), before.get("pytest", [])
    first_machine = before.get("machine")
    for d in dirs:
        # the machine record of this start: from any result file the start wrote beside the chapters
        recorded = [json.load(open(f)).get("machine") for f in sorted(glob.glob(os.path.join(d, "*.json")))
                    if not os.path.basename(f).startswith("chapter_")]
        machine_of_run = next((m for m in recorded if m), None)
        first_machine = first_machine or machine_of_run
        for f in sorted(glob.glob(os.path.join(d, "chapter_*.json"))):
            r = json.load(open(f))
            slim = {k: r[k] for k in ("chapter", "ok", "seconds", "cells_run", "failed_cell",
                                      "cells_whose_stdout_differs")}
            # what the GPU box printed where it differs from the committed notebook (timings, the
            # device's name, ...): the GPU-measured values some chapters quote
            slim["differing_cells"] = [{k: c.get(k) for k in ("index", "head", "stdout", "committed")}
                                       for c in r["cells"] if not c["stdout_matches_committed"] and not c["error"]]
            if not r["ok"]:
                cell = r["cells"][-1]
                slim["error"] = (cell["error"] or "")[-700:]
            slim["run"] = os.path.basename(os.path.normpath(d))
            if machine_of_run and machine_of_run != first_machine:
                slim["machine"] = machine_of_run
            if r["chapter"] in chapters:
                slim["earlier"] = chapters[r["chapter"]]
            chapters[r["chapter"]] = slim
        s = pytest_summary(os.path.join(d, "pytest.log"))
        if s:
            pytests.append({"run": os.path.basename(os.path.normpath(d)), **s,
                            **({"machine": machine_of_run} if machine_of_run and machine_of_run != first_machine else {})})
    payload = {"what": "every chapter executed on the GPU box (gpu.run_chapter: IPython in-process, "
                             "cells in order, stop at the first error), and the library tests (pytest tests/)",
               "chapters": chapters, "pytest": pytests}
    if first_machine:       # folded on another machine than the GPU box: keep the box's record
        with open(out, "w") as f:
            json.dump({"machine": first_machine, **payload}, f, indent=1, default=str)
            f.write("\n")
    else:
        write_json(out, payload)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
