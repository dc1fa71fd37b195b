"""The GPU results of chapters 11, 12 and 13 (read by zerolab.book.gpu_results, which shows them;
what both share is zerolab.book.gpu_results_common).

Chapter 11: each side's fast path on one H200, twice in one start (h200_2026-11-26b): fused AdamW, torch.compile,
DeepSpeed's FusedAdam. Chapter 12: the chapter executed on the GPU box (chapters.json). Chapter 13:
the H200 host step with equal host threads (h200_2026-11-26c/host_step.json), the disk row
(h200_2026-11-26/offload_cuda.json), and the earlier H100 run (offload_cuda.json) explained. Every
number is computed here from those files; nothing is measured.
"""

from __future__ import annotations

import json
import os
import re
import statistics

from ..theory.cost_model import H100_PEAK_FLOPS
from .gpu_results_common import CLIP_MARK, CLIP_NOTE, PRECISION_NOTE, RESULTS, clipped, header, precision
from .mfu import mfu

# ------------------------------------------------------------------ chapter 11
# Chapter 11 reads one machine start of one H200 (gpu/results/h200_2026-11-26b/README.md): every engine's fast
# path, eager twice and then compiled twice, all in that start, so each ratio below sets two engines of the same
# start side by side, once per repetition. Only one of the start's JSON files came back from the machine; the
# four logs hold every row's median step, tokens per second, peak memory and first steps.

# which engines answer the same question (the same states sharded): zerolab's, then its peers
FAMILIES = (("DDP", "zl.DDP", ("PyTorch DDP",)),
            ("ZeRO-1", "zl.ZeRO-1", ("DeepSpeed ZeRO-1",)),
            ("ZeRO-2", "zl.ZeRO-2", ("FSDP2 reshard=False", "DeepSpeed ZeRO-2")),
            ("ZeRO-3", "zl.ZeRO-3", ("FSDP2 reshard=True", "DeepSpeed ZeRO-3")))
H200_RUN = "h200_2026-11-26b"
H200_LOGS = {("eager", 1): "eager_rep1.log", ("eager", 2): "eager_rep2.log",
             ("compiled", 1): "compiled_rep1.log", ("compiled", 2): "compiled_rep2.log"}
H200_JSON = "fastpath_compiled_rep1.json"       # the start's machine record, model and batch
MODES, REPS = ("eager", "compiled"), (1, 2)
# "zl.DDP      58.4 ms    140,371 tok/s  MFU 38.9%  peak 18.83 GB (formula 6.50)  AdamW(fused=True)"
_SUMMARY = re.compile(r"^(?P<engine>[A-Za-z].*?)\s{2,}(?P<ms>[\d.]+) ms\s+(?P<tok>[\d,]+) tok/s\s+MFU [\d.]+%\s+"
                      r"peak (?P<peak>[\d.]+) GB \(formula (?P<formula>[\d.]+)\)\s+(?P<optimizer>.+?)\s*$")
# "[rank 0] zl.DDP compiled     median    57.5 ms, first steps 34.8, 0.1, 0.1 s"
_FIRST = re.compile(r"^\[rank 0\] (?P<engine>\S.*?)\s+median\s+[\d.]+ ms, first steps (?P<first>[\d.]+),")


def h200_runs(folder: str) -> dict:
    """{(mode, repetition): {engine: row}} from the start's four logs, engines named without ' compiled';
    a row: step_ms, tokens_per_s, peak_gb, formula_gb, optimizer (as the log names it), first_s (the first
    step's seconds, compiling included)."""
    out = {}
    for key, name in H200_LOGS.items():
        rows, first = {}, {}
        with open(os.path.join(folder, name)) as f:
            for line in f:
                if m := _FIRST.match(line):
                    first[m["engine"]] = float(m["first"])
                elif m := _SUMMARY.match(line):
                    rows[m["engine"]] = {"engine": m["engine"].removesuffix(" compiled"), "step_ms": float(m["ms"]),
                                         "tokens_per_s": float(m["tok"].replace(",", "")),
                                         "peak_gb": float(m["peak"]), "formula_gb": float(m["formula"]),
                                         "optimizer": m["optimizer"]}
        out[key] = {r["engine"]: {**r, "first_s": first.get(logged)} for logged, r in rows.items()}
    return out


def stage_ratios(runs: dict) -> list[dict]:
    """Per ZeRO stage and mode: zerolab's engine beside its fastest peer in that mode (eager beside eager,
    compiled beside compiled; the peer with the most tokens per second over both repetitions), and
    zerolab's tokens per second over the peer's in each repetition. verdict: 'ahead' or 'behind' when both
    repetitions agree, 'tie' when they disagree; peer None where no peer ran in that mode."""
    out = []
    for stage, ours, peers in FAMILIES:
        for mode in MODES:
            reps = [runs[mode, k] for k in REPS]
            if not all(ours in r for r in reps):
                continue
            ran = [p for p in peers if all(p in r for r in reps)]
            peer = max(ran, key=lambda p: sum(r[p]["tokens_per_s"] for r in reps)) if ran else None
            row = {"stage": stage, "mode": mode, "zerolab": ours, "peer": peer,
                   "zerolab_ms": [r[ours]["step_ms"] for r in reps]}
            if peer:
                row["peer_ms"] = [r[peer]["step_ms"] for r in reps]
                row["ratios"] = [r[ours]["tokens_per_s"] / r[peer]["tokens_per_s"] for r in reps]
                row["verdict"] = ("ahead" if min(row["ratios"]) > 1 else "behind" if max(row["ratios"]) < 1
                                  else "tie")
            out.append(row)
    return out


def compile_effect(runs: dict) -> dict:
    """{engine: [compiled step / eager step, per repetition]} for every engine run both ways."""
    both = [e for e in runs["compiled", 1] if all(e in runs[m, k] for m in MODES for k in REPS)]
    return {e: [runs["compiled", k][e]["step_ms"] / runs["eager", k][e]["step_ms"] for k in REPS] for e in both}


def _pair(values, fmt="{:.1f}") -> str:
    return " / ".join(fmt.format(v) for v in values)


def chapter11(results: str, chapters: dict, bench: dict) -> str:
    folder = os.path.join(results, H200_RUN)
    with open(os.path.join(folder, H200_JSON)) as f:
        meta = json.load(f)
    runs = h200_runs(folder)
    cfg, psi = bench["runs"]["world1"]["config"], meta["rows"][0]["psi"]
    assert meta["model"] == bench["runs"]["world1"]["model"], "the bench's model"
    mark = lambda e: CLIP_MARK if clipped(e, meta) else ""
    spread = max(abs(runs[k][e]["peak_gb"] - r["peak_gb"]) for e, r in runs["eager", 1].items() for k in runs
                 if e in runs[k])
    lines = [header(meta["machine"], "gpu/run_fastpath_twice.sh"), "",
             f"Each side's fast path, the way its users run it fast: the {psi / 1e6:.0f} M-parameter GPT of chapter 10 "
             f"(GPT-2 medium's shape), {meta['batch']} sequences of {cfg['block_size']:,} tokens a step, world 1 on NCCL, "
             "buckets of 25 MB; AdamW with `fused=True` for zerolab and PyTorch, DeepSpeed's own compiled FusedAdam; "
             "`compiled` = `torch.compile(model)` before zerolab wraps it, around the DDP wrapper, after "
             "`fully_shard` for FSDP2 (DeepSpeed runs eager only). Each cell is the median of 10 timed steps after 3 "
             "warm-up steps, eager twice and then compiled twice, every row in one machine start. World 1: one GPU, "
             "nothing communicated. MFU as in chapter 10 (the H200's datasheet bf16 peak is the H100's, "
             f"{H100_PEAK_FLOPS / 1e12:.0f} TFLOP/s); peak = `torch.cuda.max_memory_allocated` in the first eager "
             f"repetition (every other run of the row within {spread:.2f} GB of it); first step = the first compiled step's seconds, compiling included.", "",
             "| engine | precision | optimizer | eager step (ms), rep 1 / 2 | compiled step (ms), rep 1 / 2 | "
             "MFU eager | MFU compiled | first compiled step (s) | peak (GB) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    mfus = lambda rows: _pair([100 * mfu(x["tokens_per_s"], cfg, psi) for x in rows]) + "%"
    for engine, r in runs["eager", 1].items():
        eager = [runs["eager", k][engine] for k in REPS]
        comp = [runs["compiled", k].get(engine) for k in REPS]
        compiled = ([_pair(x["step_ms"] for x in comp), mfus(comp), f"{comp[0]['first_s']:.1f}"] if all(comp)
                    else ["-", "-", "-"])
        cells = [f"{engine}{mark(engine)}", precision(engine), r["optimizer"].split(",")[0],
                 _pair(x["step_ms"] for x in eager), compiled[0], mfus(eager), *compiled[1:], f"{r['peak_gb']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", PRECISION_NOTE, "", CLIP_NOTE, "",
              "Each ZeRO stage, eager beside eager and compiled beside compiled: zerolab's engine and its fastest peer "
              "that ran the same way, and zerolab's tokens per second over the peer's in each repetition. Two "
              "repetitions are all the start holds: a ratio on the same side of 1 in both is what this table can "
              "show, and a ratio within a few percent of 1 is close whichever side it falls.", "",
              "| stage | mode | zerolab, step (ms), rep 1 / 2 | fastest peer, step (ms), rep 1 / 2 | "
              "zerolab / peer, tokens/s, rep 1 / 2 | in both repetitions |", "|---|---|---|---|---:|---|"]
    words = {"ahead": "zerolab ahead", "behind": "the peer ahead", "tie": "a tie: they disagree"}
    for b in stage_ratios(runs):
        ours = f"{b['zerolab']}: {_pair(b['zerolab_ms'])}"
        if b["peer"] is None:
            lines.append(f"| {b['stage']} | {b['mode']} | {ours} | no peer ran {b['mode']} | - | - |")
        else:
            lines.append(f"| {b['stage']} | {b['mode']} | {ours} | {b['peer']}{mark(b['peer'])}: {_pair(b['peer_ms'])} | "
                         f"{_pair(b['ratios'], '{:.2f}')} | {words[b['verdict']]} |")
    effect = compile_effect(runs)
    helped = [e for e, v in effect.items() if max(v) < 1]
    hurt = [e for e, v in effect.items() if min(v) > 1]
    mixed = [e for e in effect if e not in helped + hurt]
    say = lambda es: ", ".join(es) or "none"
    lines += ["", f"Compiling, compiled step over eager step in each repetition: faster in both for {say(helped)}; "
                  f"slower in both for {say(hurt)}; one way in one repetition and the other in the other for "
                  f"{say(mixed)}. zerolab's hooks sit outside the model, which compiles whole; PyTorch DDP's "
                  "DDPOptimizer splits the graph at bucket boundaries (PyTorch's torch.compile documentation), "
                  "and zl.ZeRO-3 is compiled unit by unit. Where the time goes in each case was not profiled."]
    ch = chapters["chapters"].get("11_your_own_model.ipynb")
    if ch:
        m = ch.get("machine") or chapters["machine"]
        lines += ["", f"This chapter itself, executed on an {m['device']} ({m['date']}): "
                  f"{'every cell ran' if ch['ok'] else 'stopped'} in {ch['seconds']:.0f} s, printed outputs "
                  f"{'as committed then' if not ch['cells_whose_stdout_differs'] else 'different in cells ' + str(ch['cells_whose_stdout_differs'])}."]
    return "\n".join(lines)


def chapter12(chapters: dict) -> str:
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


# ------------------------------------------------------------------ chapter 13 (it reads gpu/results/h200_* itself)

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


def chapter13(off: dict, results: str | None = None) -> str:
    """Chapter 13's GPU text: the H200 run with 16 host threads for every row (the host step beside
    DeepSpeed's), the disk row of the H200's offload run, chapter 13 executed there, and why the
    earlier H100 comparison came out the other way round."""
    hs, disk = h200_host_step(results), h200_disk_row(results)
    ran = _load(H200_HOST_STEP, "chapter_13_offload.json", results)
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
