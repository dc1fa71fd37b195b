"""The memory calculator: which ZeRO stages fit a model on given devices, and with how much room.

    zl.calculator.plan(psi=7.5e9, device_gb=32, n_d=64)          # one row per stage
    zl.calculator.table1()                                        # the paper's Table 1, in GB
    zl.calculator.table2()                                        # Table 2, max theoretical size

Model states follow the paper's model (zerolab.memory.model_state_bytes: 2 + 2 + K bytes per
parameter, K = 12 for mixed-precision Adam), split N_m ways by model parallelism and then by
ZeRO over N_d data-parallel ranks. Activations follow the paper's estimate for a GPT-2-like
model, 12 * hidden * batch * seq * layers values of 2 bytes (footnote 3 of the paper); with
checkpointing one hidden-size input per layer is kept, and P_a splits it N_m ways.
"""

from __future__ import annotations

from ..memory import max_params, model_state_bytes

GB = 1e9   # the paper's tables are in decimal gigabytes
STAGES = (0, 1, 2, 3)
STAGE_LABELS = {0: "DP", 1: "ZeRO-1 (P_os)", 2: "ZeRO-2 (P_os+g)", 3: "ZeRO-3 (P_os+g+p)"}


def _positive(name, value, integer=False):
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or not value > 0:
        kind = "an int >= 1" if integer else "a number > 0"
        raise ValueError(f"{name} must be {kind}; got {value!r}")


def activation_bytes(hidden: int, batch: int, seq: int, layers: int, *, n_m: int = 1,
                     checkpointing: bool = False, partitioned: bool = False, bytes_per_value: int = 2) -> float:
    """Activation memory per device by the paper's estimate.

    Without checkpointing every layer keeps about 12 * hidden * batch * seq values; model
    parallelism does not split them (each MP rank holds the replicated layer inputs, the
    paper's section 4.2), so the estimate is per device. With checkpointing one
    hidden * batch * seq input per layer is kept; P_a (partitioned=True) splits it N_m ways.
    """
    for name, v in (("hidden", hidden), ("batch", batch), ("seq", seq), ("layers", layers), ("n_m", n_m)):
        _positive(name, v, integer=True)
    if partitioned and not checkpointing:
        raise ValueError("partitioned=True (P_a) partitions activation checkpoints: set checkpointing=True too")
    per_layer = hidden * batch * seq * (1 if checkpointing else 12)
    total = per_layer * layers * bytes_per_value
    return total / n_m if partitioned else total


def plan(psi: float, device_gb: float, n_d: int, n_m: int = 1, *, k: float = 12,
         activations_gb: float = 0.0) -> list[dict]:
    """One row per stage: model-state GB per device, activations, total, room left, fits."""
    _positive("psi", psi)
    _positive("device_gb", device_gb)
    _positive("n_d", n_d, integer=True)
    _positive("n_m", n_m, integer=True)
    if not isinstance(activations_gb, (int, float)) or activations_gb < 0:
        raise ValueError(f"activations_gb must be a number >= 0; got {activations_gb!r}")
    rows = []
    for stage in STAGES:
        states = model_state_bytes(psi / n_m, n_d, stage, k) / GB
        total = states + activations_gb
        rows.append({"stage": stage, "label": STAGE_LABELS[stage], "model_states_gb": states,
                     "activations_gb": activations_gb, "total_gb": total,
                     "room_gb": device_gb - total, "fits": total <= device_gb})
    return rows


def table1(psis=(7.5e9, 128e9, 1e12), n_ds=(1, 4, 16, 64, 256, 1024), k: float = 12) -> dict:
    """Per-device model-state GB for each model size, N_d and stage 1-3 (the paper's Table 1)."""
    return {psi: {n_d: [model_state_bytes(psi, n_d, s, k) / GB for s in (1, 2, 3)] for n_d in n_ds}
            for psi in psis}


def table2(device_gb: float = 32, n_d: int = 64, n_ms=(1, 2, 4, 8, 16), k: float = 12) -> list[dict]:
    """The largest model (parameters) per stage, for N_d = 64 and N_m = 1..16 (Table 2, left)."""
    return [{"n_m": n_m, "gpus": n_m * n_d,
             "max_params": [max_params(device_gb * GB, n_d, s, k, n_m=n_m) for s in STAGES]}
            for n_m in n_ms]


def fmt_params(n: float) -> str:
    """2e9 -> '2B', 1.28e11 -> '128B', 1e12 -> '1T', in the paper's style."""
    if n >= 1e12:
        return f"{n / 1e12:.3g}T"
    return f"{n / 1e9:.3g}B"


def _gb(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def format_table1(t=None) -> str:
    t = t or table1()
    psis = list(t)
    head = "| N_d | " + " | ".join(f"{fmt_params(p)}: {s}" for p in psis for s in ("P_os", "P_os+g", "P_os+g+p")) + " |"
    lines = [head, "|" + "---:|" * (1 + 3 * len(psis))]
    for n_d in t[psis[0]]:
        cells = [_gb(v) for p in psis for v in t[p][n_d]]
        lines.append(f"| {n_d} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_table2(rows=None) -> str:
    rows = rows or table2()
    lines = ["| N_m | GPUs | DP | P_os | P_os+g | P_os+g+p |", "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['n_m']} | {r['gpus']} | " + " | ".join(fmt_params(v) for v in r["max_params"]) + " |")
    return "\n".join(lines)


def format_plan(rows) -> str:
    lines = ["| stage | model states (GB) | activations (GB) | total (GB) | room (GB) | fits |",
             "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['label']} | {_gb(r['model_states_gb'])} | {_gb(r['activations_gb'])} | "
                     f"{_gb(r['total_gb'])} | {_gb(r['room_gb'])} | {'yes' if r['fits'] else 'no'} |")
    return "\n".join(lines)
