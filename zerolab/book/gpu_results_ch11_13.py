"""The GPU results of chapters 11, 12 and 13 (read by zerolab.book.gpu_results, which shows them).

Chapter 11: each side's fast path on one H200, twice in one start (h200_2026-11-26b): fused AdamW, torch.compile,
DeepSpeed's FusedAdam. Chapter 12: the chapter executed on the GPU box (chapters.json). Chapter 13:
offload on CUDA beside DeepSpeed's offload_optimizer (offload_cuda.json). Every number is computed
here from those files; nothing is measured.
"""

from __future__ import annotations

import re

from ..theory.cost_model import H100_PEAK_FLOPS

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
    import os
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


def chapter11(results: str, chapters: dict, bench: dict, header) -> str:
    import json
    import os
    from . import gpu_results as gr
    from .mfu import mfu
    folder = os.path.join(results, H200_RUN)
    with open(os.path.join(folder, H200_JSON)) as f:
        meta = json.load(f)
    runs = h200_runs(folder)
    cfg, psi = bench["runs"]["world1"]["config"], meta["rows"][0]["psi"]
    assert meta["model"] == bench["runs"]["world1"]["model"], "the bench's model"
    mark = lambda e: gr.CLIP_MARK if gr.clipped(e, meta) else ""
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
        cells = [f"{engine}{mark(engine)}", gr.precision(engine), r["optimizer"].split(",")[0],
                 _pair(x["step_ms"] for x in eager), compiled[0], mfus(eager), *compiled[1:], f"{r['peak_gb']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", gr.PRECISION_NOTE, "", gr.CLIP_NOTE, "",
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


def _offload_row(r, pcie):
    t = r.get("transfers") or []
    if t:
        d2h, h2d = t[-1]["d2h"], t[-1]["h2d"]
        moved = (f"{d2h[0] / 1e6:.0f} MB in {d2h[1] * 1e3:.1f} ms | {h2d[0] / 1e6:.0f} MB in {h2d[1] * 1e3:.1f} ms | "
                 f"{2 * r['psi'] / 1e6:.0f} MB, {2 * r['psi'] / pcie['host_to_device'] * 1e3:.1f} ms")
    else:
        moved = "- | - | -"
    diff = f"{r['max_abs_diff']:.1e}" if "max_abs_diff" in r else "-"
    times = sorted(r["times"])
    return (f"| {r['engine']} | {r['offload'] or 'none'} | {r['optimizer']} | {r['step_ms']:.0f} ({times[0] * 1e3:.0f}-"
            f"{times[-1] * 1e3:.0f}) | {r['peak_bytes'] / 1e9:.2f} | {moved} | {diff} |")


def offload_speed(off: dict) -> dict:
    """The second start's zerolab (fused host AdamW) and DeepSpeed (CPU-Adam) ZeRO-2 offload steps."""
    rows = off["runs"]["second"]["rows"]
    zl = next(r for r in rows if r.get("ok") and r["engine"] == "zl.ZeRO-2" and r.get("host_adam_fused"))
    plain = next(r for r in rows if r.get("ok") and r["engine"] == "zl.ZeRO-2" and r["offload"] and not r.get("host_adam_fused"))
    ds = next(r for r in rows if r.get("ok") and r["engine"] == "DeepSpeed ZeRO-2")
    gpu = next(r for r in rows if r.get("ok") and r["engine"] == "zl.ZeRO-2" and not r["offload"])
    first = [r for r in off["runs"]["first"]["rows"] if r.get("ok") and r["engine"] == "zl.ZeRO-2" and r["offload"]][0]
    return {"zl_fused_ms": zl["step_ms"], "zl_plain_ms": plain["step_ms"], "deepspeed_ms": ds["step_ms"],
            "no_offload_ms": gpu["step_ms"], "zl_over_deepspeed": zl["step_ms"] / ds["step_ms"],
            "h2d_ms_before": first["transfers"][-1]["h2d"][1] * 1e3, "h2d_ms_after": zl["transfers"][-1]["h2d"][1] * 1e3}


def chapter13(off: dict, chapters: dict, header) -> str:
    s = offload_speed(off)
    lines = [header(off["machine"]), "",
             "Offload on CUDA, world 1: the 163 M-parameter GPT (GPT-2 small shape, untied head) in bf16, 8 sequences "
             "of 1,024 tokens a step; one run per row on each of two machine starts, median step of 3 after 2 warm-up "
             "steps (min-max in brackets); zerolab's ledger "
             "of device-host copies (`engine.transfers`) per step beside the closed form 2Ψ bytes each way (bf16) and "
             "those bytes at the pinned copy rate measured first; the largest difference of any weight after 5 steps "
             "from the same stage without offload (on a GPU one update runs on the GPU and one on the host, so they "
             "differ by round-off; on the CPU this chapter shows them equal bit for bit).", ""]
    head = ["| engine | offload | optimizer | step (ms) | GPU peak (GB) | down (d2h) | up (h2d) | closed form, at the "
            "pinned rate | max weight diff |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for run, title in (("second", "Second machine start"), ("first", "First machine start")):
        r = off["runs"][run]
        lines += [f"**{title}** (pinned copies {r['pcie']['host_to_device'] / 1e9:.1f} GB/s up, "
                  f"{r['pcie']['device_to_host'] / 1e9:.1f} GB/s down). {r['note'][0].upper() + r['note'][1:]}.", "", *head]
        for row in r["rows"]:
            lines.append(_offload_row(row, r["pcie"]) if row.get("ok") else
                         f"| {row['engine']} | {row['offload']} | not run: {row['error'][:80]} | | | | | | |")
        lines.append("")
    lines += [f"The host's optimizer is the step here: ZeRO-2 without offload takes {s['no_offload_ms']:.0f} ms, with "
              f"offload {s['zl_plain_ms']:.0f} ms with torch's AdamW, {s['zl_fused_ms']:.0f} ms with "
              f"`AdamW(fused=True)` (one vectorised pass over the shard), and DeepSpeed's CPU-Adam {s['deepspeed_ms']:.0f} ms: "
              f"zerolab's offloaded step is {s['zl_over_deepspeed']:.2f}x DeepSpeed's. The copies are not the cost: "
              f"sending the bf16 parameters up took {s['h2d_ms_before']:.0f} ms when the host converted fp32 to bf16 inside "
              f"the copy (one core) and {s['h2d_ms_after']:.0f} ms once it converts first, into pinned memory, on all cores."]
    ch = chapters["chapters"].get("13_offload.ipynb")
    if ch and not ch["ok"]:
        lines += ["", "This chapter's own cells, executed on the GPU box, stopped at the memory-budget check: host "
                  "buffers were pinned there for CPU tensors too, and pinning creates a CUDA context (hundreds of MB "
                  "of the process's memory). zerolab pins only the buffers a GPU copies; the chapter has not been "
                  "executed on a GPU since."]
    return "\n".join(lines)
