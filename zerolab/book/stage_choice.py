"""Chapter 10: choosing a stage from memory (the calculator) and time (the cost model).

Nothing here is measured: memory per GPU is the paper's model-state formula
(zerolab.theory.calculator.plan), time is zerolab.theory.cost_model.step_estimate on the hardware it
assumes. Activations are left out: they are the same for every stage (checkpointing and P_a
change them, not the stage), so they shift every point alike.

    choice_rows(psi, n, device_gb, tokens)   per stage and tokens per GPU: GB, fits, step time
    format_choice(rows)                      the same as a Markdown table
"""

from __future__ import annotations

from ..theory import calculator as calc
from ..theory import cost_model as cm

STAGE_NAMES = {0: "DP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}


def choice_rows(psi: float, n: int, device_gb: float, tokens=(2048, 16384),
                cluster: cm.Cluster = cm.H100_CLUSTER) -> list[dict]:
    """One row per stage and per tokens-per-GPU setting."""
    memory = {r["stage"]: r for r in calc.plan(psi, device_gb, n)}
    rows = []
    for t in tokens:
        for stage in (0, 1, 2, 3):
            est = cm.step_estimate(stage, psi, n, t, cluster)
            rows.append({"stage": stage, "name": STAGE_NAMES[stage], "tokens": t,
                         "gb": memory[stage]["model_states_gb"], "fits": memory[stage]["fits"],
                         "compute_ms": 1e3 * est.compute_s, "comm_ms": 1e3 * est.comm_s,
                         "exposed_ms": 1e3 * est.exposed_s, "step_ms": 1e3 * est.step_s})
    return rows


def format_choice(rows) -> str:
    lines = ["| tokens per GPU | stage | model states (GB) | fits | compute (ms) | communication (ms) | "
             "exposed (ms) | step (ms) |", "|---:|---|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['tokens']:,} | {r['name']} | {r['gb']:.1f} | {'yes' if r['fits'] else 'no'} | "
                     f"{r['compute_ms']:,.0f} | {r['comm_ms']:,.0f} | {r['exposed_ms']:,.0f} | {r['step_ms']:,.0f} |")
    return "\n".join(lines)
