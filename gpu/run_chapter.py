"""Execute one chapter's code cells in order, in-process, the way a kernel would.

    python -m gpu.run_chapter chapters/05_ddp.ipynb OUT.json

IPython's InteractiveShell runs each cell (magics and display work; figures are drawn with
the Agg backend), from the chapter's own folder, as Jupyter Book does. For each cell it
records an error (with the traceback's tail) and whether its printed text equals the
committed output (what nbval compares; timings and machine-dependent numbers differ
by design, see tests/nbval_sanitize.cfg). Used on a GPU box that has no Jupyter kernel.
"""

from __future__ import annotations

import io
import json
import os
import sys
import time
import traceback


def committed_text(cell):
    out = []
    for o in cell.get("outputs", []):
        if o.get("output_type") == "stream" and o.get("name") == "stdout":
            out.append("".join(o["text"]))
    return "".join(out)


def _stand_in_for_myst_nb():
    """The chapters glue numbers into their prose with myst_nb.glue, which needs Jupyter Book;
    a GPU box without it gets a stand-in that displays the value, as glue does in a notebook."""
    try:
        import myst_nb  # noqa: F401
    except ImportError:
        import types
        from IPython.display import display
        stand_in = types.ModuleType("myst_nb")

        def glue(name, variable, display_value=True, **_):
            if display_value:
                display(variable)
        stand_in.glue = glue
        sys.modules["myst_nb"] = stand_in


def main(nb_path, out_path):
    os.environ.setdefault("MPLBACKEND", "Agg")
    nb_path = os.path.abspath(nb_path)
    with open(nb_path) as f:
        nb = json.load(f)
    os.chdir(os.path.dirname(nb_path))
    sys.path.insert(0, os.path.dirname(nb_path))
    _stand_in_for_myst_nb()
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output
    shell = InteractiveShell.instance()
    # a kernel sends the last expression's value as a display (not compared here); the plain
    # shell would print "Out[n]: ..." into stdout and spoil the comparison with committed text
    shell.ast_node_interactivity = "none"
    cells, t0, failed = [], time.time(), None
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        src = "".join(cell["source"])
        t = time.time()
        with capture_output() as cap:
            res = shell.run_cell(src, store_history=True)
        err = None
        if not res.success:
            e = res.error_in_exec or res.error_before_exec
            err = "".join(traceback.format_exception(type(e), e, e.__traceback__))[-2500:]
        want = committed_text(cell)
        rec = {"index": i, "seconds": round(time.time() - t, 2), "error": err,
               "stdout_matches_committed": cap.stdout == want,
               "head": src.splitlines()[0][:80] if src else ""}
        if cap.stdout != want:
            rec["stdout"] = cap.stdout[-1500:]
            rec["committed"] = want[-1500:]
        cells.append(rec)
        if err and failed is None:
            failed = i
            print(f"{os.path.basename(nb_path)} cell {i} FAILED:\n{err[-1500:]}", flush=True)
            break   # like a kernel run with raise-on-error: later cells depend on earlier ones
    out = {"chapter": os.path.basename(nb_path), "ok": failed is None, "seconds": round(time.time() - t0, 1),
           "cells_run": len(cells), "failed_cell": failed,
           "cells_whose_stdout_differs": [c["index"] for c in cells if not c["stdout_matches_committed"]],
           "cells": cells}
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"{out['chapter']}: {'ok' if out['ok'] else 'FAILED'} in {out['seconds']} s, "
          f"{len(cells)} cells, stdout differs in {out['cells_whose_stdout_differs']}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
