"""The GPU results of chapters 11, 12 and 13 (read by zerolab.book.gpu_results, which shows them).

Chapter 11: each side's fast path on one H100 (gpu/results/fastpath.json): fused AdamW, torch.compile,
DeepSpeed's FusedAdam. Chapter 12: the chapter executed on the GPU box (chapters.json). Chapter 13:
offload on CUDA beside DeepSpeed's offload_optimizer (offload_cuda.json). Every number is computed
here from those files; nothing is measured.
"""

from __future__ import annotations

import re

from ..theory.cost_model import H100_PEAK_FLOPS

# which engines answer the same question (the same states sharded): zerolab's, then its peers
FAMILIES = (("DDP", "zl.DDP", ("PyTorch DDP",)),
            ("ZeRO-1", "zl.ZeRO-1", ("DeepSpeed ZeRO-1",)),
            ("ZeRO-2", "zl.ZeRO-2", ("FSDP2 reshard=False", "DeepSpeed ZeRO-2")),
            ("ZeRO-3", "zl.ZeRO-3", ("FSDP2 reshard=True", "DeepSpeed ZeRO-3")))


def _ran(rows):
    return {r["engine"]: r for r in rows if r.get("ok")}


def fastpath_rows(fast: dict) -> dict:
    """{engine name (with ' compiled'): row} over the eager, compiled and DeepSpeed runs."""
    out = {}
    for run in ("eager", "compiled", "deepspeed_fused"):
        out.update(_ran(fast["runs"][run]["rows"]))
    return out


def best_of_each_family(fast: dict) -> list[dict]:
    """Per ZeRO stage and per mode (eager, compiled): zerolab's row beside its fastest peer IN THE SAME MODE
    (a compiled engine is never set against an eager one), the ratio of their median tokens/s, and whether
    their fastest-to-slowest step ranges overlap (then the difference is within the run's own noise).
    peer is None where no peer ran in that mode (DeepSpeed runs eager only)."""
    rows = fastpath_rows(fast)
    out = []
    for stage, ours, peers in FAMILIES:
        for mode, suffix in (("eager", ""), ("compiled", " compiled")):
            mine = rows.get(ours + suffix)
            if mine is None:
                continue
            theirs = [rows[p + suffix] for p in peers if p + suffix in rows]
            best = max(theirs, key=lambda r: r["tokens_per_s"]) if theirs else None
            row = {"stage": stage, "mode": mode, "zerolab": mine, "peer": best}
            if best is not None:
                row["ratio"] = mine["tokens_per_s"] / best["tokens_per_s"]
                row["overlap"] = (mine["step_ms_min"] <= best["step_ms_max"] and best["step_ms_min"] <= mine["step_ms_max"])
            out.append(row)
    return out


def _span(r) -> str:
    start = ", second machine start" if r["engine"].startswith("DeepSpeed") else ""
    return f"{r['engine']}: {r['step_ms']:.1f} ({r['step_ms_min']:.0f}-{r['step_ms_max']:.0f}{start})"


def _fast_row(r, second=False):
    first = r["warmup_s"][0]
    return (f"| {r['engine']}{' (second start)' if second else ''} | {r['optimizer'].split(',')[0]} | {r['step_ms']:.1f} ({r['step_ms_min']:.0f}-"
            f"{r['step_ms_max']:.0f}) | {r['tokens_per_s']:,.0f} | {100 * r['tokens_per_s'] * _fpt(r) / H100_PEAK_FLOPS:.1f}% | "
            f"{first:.1f} | {r['peak_bytes'] / 1e9:.2f} |")


def _fpt(r):
    # FLOPs per token as the run computed them (MFU over the datasheet = fpt * tok/s / peak)
    return r["mfu_datasheet"] * H100_PEAK_FLOPS / r["tokens_per_s"]


def chapter11(fast: dict, chapters: dict, header) -> str:
    eager = fast["runs"]["eager"]
    psi = eager["rows"][0]["psi"]
    rows = fastpath_rows(fast)
    lines = [header(fast["machine"]), "",
             f"Each side's fast path, the way its users run it fast: a {psi / 1e6:.0f} M-parameter GPT (GPT-2 medium "
             f"shape) in bf16, {eager['batch']} sequences of 1,024 tokens a step, world 1 on NCCL, buckets of 25 MB; "
             "AdamW with `fused=True` for zerolab and PyTorch, DeepSpeed's own compiled FusedAdam; `compiled` = "
             "`torch.compile(model)` before zerolab wraps it, around the DDP wrapper, after `fully_shard` for FSDP2 "
             "(DeepSpeed eager only). Median of 10 timed steps (min-max in brackets) after 3 warm-up steps; the "
             "first step's seconds include compiling. World 1: one GPU, nothing communicated. MFU over the datasheet's "
             f"{H100_PEAK_FLOPS / 1e12:.0f} TFLOP/s; peak = `torch.cuda.max_memory_allocated`. One run per row, "
             "on one machine start: the step times of one engine spread by up to 2x within it. "
             "DeepSpeed's rows come from a second machine start: in the first, its op builder could not parse "
             "the machine's `TORCH_CUDA_ARCH_LIST` (\"9.0a\"); the second set it to 9.0.",
             "", "| engine | optimizer | step (ms) | tokens/s | MFU | first step (s) | peak (GB) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for run in ("eager", "deepspeed_fused", "compiled"):
        for r in fast["runs"][run]["rows"]:
            if r.get("ok"):
                lines.append(_fast_row(r, second=run == "deepspeed_fused"))
            elif r["engine"] not in rows:      # (a row that ran in the other start is shown from there)
                why = ("not measured: the op builder failed in the first start, the time limit cut the second"
                       if r["engine"].startswith("DeepSpeed") else f"not run: {r['error'][:70]}")
                lines.append(f"| {r['engine']} | {why} | | | | | |")
    lines += ["", "Each ZeRO stage, eager beside eager and compiled beside compiled: zerolab's engine and the fastest "
                  "peer that ran the same way, step in ms as median (fastest-slowest). World 1 is one GPU: no "
                  "collective moves a byte, so a ratio here measures what each engine costs around the same "
                  "arithmetic, not how it communicates. Where the two step ranges overlap, the difference is within "
                  "the run's own noise.", "",
              "| stage | mode | zerolab, step (ms) | fastest peer, step (ms) | zerolab / peer, tokens/s | ranges |",
              "|---|---|---|---|---:|---|"]
    for b in best_of_each_family(fast):
        if b["peer"] is None:
            lines.append(f"| {b['stage']} | {b['mode']} | {_span(b['zerolab'])} | no peer ran {b['mode']} | - | - |")
        else:
            lines.append(f"| {b['stage']} | {b['mode']} | {_span(b['zerolab'])} | {_span(b['peer'])} | "
                         f"{b['ratio']:.2f} | {'overlap: a tie' if b['overlap'] else 'apart'} |")
    ddp, ddp_c = rows.get("PyTorch DDP"), rows.get("PyTorch DDP compiled")
    if ddp and ddp_c:
        lines += ["", f"Compiling did not help PyTorch DDP here ({ddp['step_ms']:.0f} ms eager, {ddp_c['step_ms']:.0f} ms "
                  "compiled). Compiled, DDP's DDPOptimizer splits the graph at bucket boundaries (PyTorch's "
                  "torch.compile documentation); zerolab's hooks sit outside the model, which compiles whole. Why "
                  "the split graph ran slower here was not profiled. DeepSpeed ZeRO-3 with FusedAdam did not finish "
                  "inside its run's time limit."]
    ch = chapters["chapters"].get("11_your_own_model.ipynb")
    if ch:
        lines += ["", f"This chapter itself, executed on the GPU box: {'every cell ran' if ch['ok'] else 'stopped'} in "
                  f"{ch['seconds']:.0f} s, printed outputs {'as above' if not ch['cells_whose_stdout_differs'] else 'different in cells ' + str(ch['cells_whose_stdout_differs'])}."]
    return "\n".join(lines)


def chapter12(chapters: dict, header) -> str:
    ch = chapters["chapters"]["12_zeropp_and_hierarchy.ipynb"]
    # the run compared: the cell's step count then (the chapter's own run may train fewer steps now)
    steps = {n for c in ch["differing_cells"] for n in re.findall(r"of (\d+) steps", c["committed"])}
    run = f", training the quantised options for {steps.pop()} steps" if len(steps) == 1 else ""
    lines = [header(ch.get("machine") or chapters["machine"]), "",
             f"The same cells on another machine's CPU (torch {(ch.get('machine') or chapters['machine'])['torch']}, "
             f"another processor){run}, beside this machine's run of the same: the parity lines print the same; "
             "the quantised runs' mean losses move in the "
             "third decimal, since rounding to int8 or int4 amplifies the last bits that another order of "
             "summation changes:", ""]
    for c in ch["differing_cells"]:
        lines += ["| here | on the GPU box |", "|---|---|"]
        for a, b in zip(c["committed"].splitlines(), c["stdout"].splitlines()):
            if a != b:
                lines.append(f"| `{a.strip()}` | `{b.strip()}` |")
    lines += ["", "No multi-GPU NCCL run stands behind this chapter's cluster figures: the GPU machines these "
              "results come from have one GPU each (NCCL needs a GPU per rank). Every millisecond of communication "
              "on a cluster above is the cost model's, which the cost model checks page sets beside published "
              "measurements of real clusters."]
    return "\n".join(lines)


# ------------------------------------------------------------------ chapter 13

import json        # noqa: E402  (chapter 13's own: it reads gpu/results/h200_* itself)
import os          # noqa: E402
import statistics  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "gpu",
                       "results")
H200_HOST_STEP = "h200_2026-11-26c"     # the host step with 16 threads for every row, and chapter 13 run there
H200_OFFLOAD = "h200_2026-11-26"        # offload_cuda on the H200: the disk row ran there
# the rows of the H200 table, in order: (label, row of host_step.json, zerolab's or DeepSpeed's)
HOST_STEP_ROWS = (("whole iteration (forward, backward, step)", "zl iteration, fused", "DeepSpeed ZeRO-2 offload iteration"),
                  ("the step (bus, casts, update, gather)", "zl step, fused", "DeepSpeed ZeRO-2 offload step"),
                  ("the update alone, same flat tensors", "AdamW fused, alone", "DeepSpeedCPUAdam, alone"))


def _load(folder: str, name: str, results: str | None = None) -> dict | None:
    path = os.path.join(results or RESULTS, folder, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _spread(times: list) -> dict:
    """median, min and max in ms of the rounds after the first (the warm-up)."""
    ms = [1e3 * t for t in times[1:]]
    return {"median": statistics.median(ms), "min": min(ms), "max": max(ms), "rounds": len(ms)}


def h200_host_step(results: str | None = None) -> dict | None:
    """The H200 run with equal host threads (gpu.host_step): {row name: median/min/max ms} computed
    from the rounds the file holds, with the run's thread count; None when the file is missing."""
    hs = _load(H200_HOST_STEP, "host_step.json", results)
    if hs is None:
        return None
    rows = {name: _spread(times) for name, times in hs["rows"].items()}
    for name, r in rows.items():                # the script's own summary, recomputed here
        assert abs(r["median"] - hs["table"][name]["median_ms"]) < 1e-6, name
    return {"machine": hs["machine"], "threads": hs["threads"], "psi": hs["psi"], "rows": rows,
            "host_bytes": hs["host_bytes"]}


def h200_disk_row(results: str | None = None) -> dict | None:
    """offload="disk" on the H200 (gpu.offload_cuda under zl.launch: one host thread), beside
    offload="optimizer" at the same stage and without offload, from the same start."""
    off = _load(H200_OFFLOAD, "offload_cuda.json", results)
    if off is None:
        return None
    rows = {(r["stage"], r["offload"], r.get("host_adam_fused")): r for r in off["rows"] if r.get("ok")}
    disk = rows[(3, "disk", True)]
    return {"disk_ms": disk["step_ms"], "optimizer_ms": rows[(3, "optimizer", True)]["step_ms"],
            "no_offload_ms": rows[(3, None, False)]["step_ms"],
            "written_per_step": [w for _, w in disk["disk_io"]], "read_per_step": [r for r, _ in disk["disk_io"]]}


def h100_speed(off: dict) -> dict:
    """The H100 run's second start (gpu.offload_cuda under zl.launch): zerolab's host AdamW on the one
    thread zl.launch gives each rank, DeepSpeed's CPU-Adam its own OpenMP loop."""
    rows = off["runs"]["second"]["rows"]
    zl = next(r for r in rows if r.get("ok") and r["engine"] == "zl.ZeRO-2" and r.get("host_adam_fused"))
    ds = next(r for r in rows if r.get("ok") and r["engine"] == "DeepSpeed ZeRO-2")
    return {"zl_fused_ms": zl["step_ms"], "deepspeed_ms": ds["step_ms"], "zl_over_deepspeed": zl["step_ms"] / ds["step_ms"]}


def chapter13(off: dict, chapters: dict, header) -> str:
    """Chapter 13's GPU text: the H200 run with 16 host threads for every row (the host step beside
    DeepSpeed's), the disk row of the H200's offload run, chapter 13 executed there, and why the
    earlier H100 comparison came out the other way round."""
    hs, disk = h200_host_step(), h200_disk_row()
    ran = _load(H200_HOST_STEP, "chapter_13_offload.json")
    if hs is None or disk is None or ran is None:
        return f"No GPU results here (gpu/results/{H200_HOST_STEP} or {H200_OFFLOAD} missing)."
    m, r = hs["machine"], hs["rows"]
    cell = lambda name: (f"{r[name]['median']:.1f} ({r[name]['min']:.1f}-{r[name]['max']:.1f})")   # noqa: E731
    lines = [f"**Measured on a GPU ({m['device']}, {m['date']})**: torch {m['torch']}, CUDA {m['cuda']}, driver "
             f"{m['driver']}; written by `python -m gpu.host_step --device cuda --deepspeed`, not re-run here.", "",
             f"The {hs['psi'] / 1e6:.0f} M-parameter GPT in bf16, world 1, `offload=\"optimizer\"` at stage 2; 8 "
             f"sequences of 1,024 tokens a backward; **{hs['threads']} host threads for every row**. Milliseconds, "
             f"median (min-max) of {r['zl iteration, fused']['rounds']} rounds after a warm-up round, rows taken in "
             "turn. zerolab runs `AdamW(fused=True)` on the host; DeepSpeed its compiled CPU-Adam. DeepSpeed's "
             "rows clip the gradient norm to 1.0 (its default in that run); zerolab's do not clip.", "",
             "| what | zerolab | DeepSpeed | zerolab / DeepSpeed |", "|---|---:|---:|---:|"]
    for label, ours, theirs in HOST_STEP_ROWS:
        lines.append(f"| {label} | {cell(ours)} | {cell(theirs)} | {r[ours]['median'] / r[theirs]['median']:.2f} |")
    lines += ["", f"Inside zerolab's step: the update {cell('zl step, fused: the update inside')}, the bus copies "
              f"{cell('zl step, fused: bus copies')}, the casts, check and gather {cell('zl step, fused: rest (casts, check, gather)')}. "
              f"With torch's default foreach AdamW the update alone takes {cell('AdamW foreach, alone')} and the "
              f"iteration {cell('zl iteration, foreach')}. DeepSpeed's step is the shorter because its gradients "
              "went down to the host during the backward; zerolab's go down after it.", "",
              f"`offload=\"disk\"` on the same H200 (an earlier start, run by `gpu.offload_cuda` under `zl.launch`, "
              f"so its host update had one thread): {disk['disk_ms']:,.0f} ms a step at stage 3, against "
              f"{disk['optimizer_ms']:,.0f} ms with `offload=\"optimizer\"` and {disk['no_offload_ms']:.0f} ms "
              f"without offload, writing {min(disk['written_per_step']) / 1e9:.2f}-{max(disk['written_per_step']) / 1e9:.2f} "
              f"GB a step; it read {max(disk['read_per_step'])} bytes from the drive (the page cache served every read).", "",
              f"This chapter ran to the end on that H200 in {ran['seconds']:.1f} s; every cell printed what it prints "
              "here except the two that print timings and the resident set."]
    h = h100_speed(off)
    lines += ["", f"An earlier H100 run (gpu/results/offload_cuda.json) put zerolab's offloaded step at "
              f"{h['zl_over_deepspeed']:.2f}x DeepSpeed's ({h['zl_fused_ms']:.0f} against {h['deepspeed_ms']:.0f} ms). "
              "It was not like for like: that script started its rank with `zl.launch`, which gives each rank one "
              "thread, so zerolab's host AdamW ran on one core while DeepSpeed's CPU-Adam ran its own OpenMP loop "
              "over the host's cores. With the same threads for both, the order reverses."]
    return "\n".join(lines)
