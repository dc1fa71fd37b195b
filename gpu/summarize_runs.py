"""Fold the chapter runs (gpu.run_chapter JSON files) and a pytest log into one small JSON.

    python -m gpu.summarize_runs OUT.json RUN_DIR [RUN_DIR ...]

A later RUN_DIR's chapter replaces an earlier one's (a re-run after a fix); the earlier
result is kept under "earlier" so the failure that was fixed stays on record.
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
    bad = sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.M)))
    return {"summary": last[-1].strip("= ") if last else None, "failed_or_error": bad}


def main(out, dirs):
    chapters, pytests = {}, []
    for d in dirs:
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
            if r["chapter"] in chapters:
                slim["earlier"] = chapters[r["chapter"]]
            chapters[r["chapter"]] = slim
        s = pytest_summary(os.path.join(d, "pytest.log"))
        if s:
            pytests.append({"run": os.path.basename(os.path.normpath(d)), **s})
    write_json(out, {"what": "every chapter executed on the GPU box (gpu.run_chapter: IPython in-process, "
                             "cells in order, stop at the first error), and the library tests (pytest tests/)",
                     "chapters": chapters, "pytest": pytests})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
