"""The ZeRO paper's Tables 1 and 2 as printed, beside the calculator's exact values (chapter 10).

The calculator (zerolab.theory.calculator) evaluates the paper's formulas exactly and prints them with
Python's rounding; a few cells then read differently from the paper. This module finds those
cells and says why, by recomputing each one the ways a table could have been rounded:

    table1_differences()   cells of Table 1 whose printed value differs from Python's rounding
    table2_scaling()       Table 2's P_os and P_os+g columns: exact, printed, printed / N_m

The printed values are typed from the paper (Rajbhandari et al., "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", Tables 1 and 2) as strings, so that the number of
decimals the paper printed is kept.
"""

from __future__ import annotations

from decimal import ROUND_FLOOR, ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal

from ..theory.calculator import table1, table2

# Table 1: per-device GB, stages P_os, P_os+g, P_os+g+p, for each model size and N_d
PAPER_TABLE1 = {
    7.5e9: {1: ("120", "120", "120"), 4: ("52.5", "41.3", "30"), 16: ("35.6", "21.6", "7.5"),
            64: ("31.4", "16.6", "1.88"), 256: ("30.4", "15.4", "0.47"), 1024: ("30.1", "15.1", "0.12")},
    128e9: {1: ("2048", "2048", "2048"), 4: ("896", "704", "512"), 16: ("608", "368", "128"),
            64: ("536", "284", "32"), 256: ("518", "263", "8"), 1024: ("513", "257", "2")},
    1e12: {1: ("16000", "16000", "16000"), 4: ("7000", "5500", "4000"), 16: ("4750", "2875", "1000"),
           64: ("4187", "2218", "250"), 256: ("4046", "2054", "62.5"), 1024: ("4011", "2013", "15.6")},
}
# Table 2 (left half): billions of parameters for P_os and P_os+g, 32 GB devices, N_d = 64
PAPER_TABLE2 = {1: ("7.6", "14.4"), 2: ("15.2", "28.8"), 4: ("30.4", "57.6"), 8: ("60.8", "115.2"),
                16: ("121.6", "230.4")}
STAGE_NAMES = ("P_os", "P_os+g", "P_os+g+p")


def _round(value: float, decimals: int, mode) -> Decimal:
    # Decimal(value) is the float's exact binary value: 41.25 is exactly 41.25, so a tie is a tie
    return Decimal(value).quantize(Decimal(1).scaleb(-decimals), rounding=mode)


def _decimals(printed: str) -> int:
    return len(printed.split(".")[1]) if "." in printed else 0


def reason(exact: float, printed: str) -> str:
    """Which rounding of the exact value gives the paper's printed value."""
    d, paper = _decimals(printed), Decimal(printed)
    if _round(exact, d, ROUND_HALF_EVEN) == paper:
        return "same rounding"
    if _round(exact, d, ROUND_HALF_UP) == paper:
        return "a tie: the paper rounds half up, Python half to even"
    if _round(exact, d, ROUND_FLOOR) == paper:
        return "the paper drops the fraction"
    return "not a rounding of the formula"


def table1_differences() -> list[dict]:
    """Cells where the paper's value differs from the exact value rounded as Python does (half
    to even) to the paper's own number of decimals, with the rounding that explains it."""
    ours = table1()
    out = []
    for psi, rows in PAPER_TABLE1.items():
        for n_d, printed in rows.items():
            for stage, (exact, paper) in enumerate(zip(ours[psi][n_d], printed)):
                why = reason(exact, paper)
                if why != "same rounding":
                    out.append({"psi": psi, "n_d": n_d, "stage": STAGE_NAMES[stage], "exact": exact,
                                "paper": paper, "python": str(_round(exact, _decimals(paper), ROUND_HALF_EVEN)),
                                "reason": why})
    return out


def table2_scaling() -> list[dict]:
    """Table 2's P_os and P_os+g columns: the exact maximum (billions), the paper's, and each
    divided by N_m. The paper's quotient is the same in every row: its N_m = 1 value, already
    rounded, times N_m."""
    out = []
    for row in table2():
        n_m = row["n_m"]
        for col, stage in enumerate((1, 2)):
            exact = row["max_params"][stage] / 1e9
            paper = float(PAPER_TABLE2[n_m][col])
            out.append({"n_m": n_m, "stage": STAGE_NAMES[stage - 1], "exact_b": exact, "paper_b": paper,
                        "exact_per_nm": exact / n_m, "paper_per_nm": paper / n_m})
    return out


def _size(psi: float) -> str:
    return f"{psi / 1e12:g}T" if psi >= 1e12 else f"{psi / 1e9:g}B"


def format_table1_differences(rows=None) -> str:
    rows = table1_differences() if rows is None else rows
    lines = ["| model | N_d | stage | exact (GB) | Python prints | paper prints | why |",
             "|---|---:|---|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {_size(r['psi'])} | {r['n_d']} | {r['stage']} | {r['exact']:g} | {r['python']} | "
                     f"{r['paper']} | {r['reason']} |")
    return "\n".join(lines)


def format_table2_scaling(rows=None) -> str:
    rows = table2_scaling() if rows is None else rows
    lines = ["| N_m | stage | exact (B params) | paper | exact / N_m | paper / N_m |", "|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['n_m']} | {r['stage']} | {r['exact_b']:.2f} | {r['paper_b']:g} | "
                     f"{r['exact_per_nm']:.2f} | {r['paper_per_nm']:.2f} |")
    return "\n".join(lines)
