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
