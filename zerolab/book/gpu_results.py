"""The results measured on a GPU box (gpu/results/), shown beside the chapters' CPU runs.

    import zerolab.book.gpu_results as gr
    gr.show(10)          # "Measured on a GPU (NVIDIA H100 80GB HBM3, 2026-11-23)": a table and a figure

The chapters execute on 2 CPU cores with gloo; the files under gpu/results/ were written by
gpu/run_all.sh on one GPU (see README, "Reproduce the GPU results"). This module only reads
them: it never touches CUDA and never re-measures, so its output is the same on every machine.
Chapters with a GPU result: 2, 5, 8, 9, 10, and 11-13 (zerolab.book.gpu_results_ch11_13). MFU is counted one
way everywhere (zerolab.book.mfu: without the embedding lookups).
"""

from __future__ import annotations

import json
import os

from ..theory.cost_model import H100_PEAK_FLOPS
from . import gpu_results_ch11_13 as later
from . import mfu as model_flops
from .gpu_results_common import CLIP_MARK, CLIP_NOTE, PRECISION_NOTE, RESULTS, clipped, header, precision

CHAPTERS = (2, 5, 8, 9, 10, 11, 12, 13)
FILES = ("parity.json", "bench.json", "bench_rep2.json", "memory_snapshot.json", "profile.json", "offload.json",
         "overlap.json", "chapters.json", "fastpath.json", "offload_cuda.json",
         os.path.join(later.H200_RUN, later.H200_JSON), os.path.join(later.H200_HOST_STEP, "host_step.json"),
         os.path.join(later.H200_OFFLOAD, "offload_cuda.json"))
LOGS = tuple(os.path.join(later.H200_RUN, name) for name in later.H200_LOGS.values())   # chapter 11's medians
FIGURES = {5: "profile.png", 9: "memory_snapshot.png", 10: "bench.png"}


def load(name: str, results: str | None = None) -> dict | None:
    """One committed result file, parsed; None when it is not there."""
    path = os.path.join(results or RESULTS, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _gb(x) -> str:
    return "n/a" if x is None else f"{x / 1e9:.2f}"


def _gib(x) -> str:
    return f"{x / 2 ** 30:.2f}"


def _rows(bench: dict, run: str) -> dict:
    return {r["engine"]: r for r in bench["runs"][run]["rows"]}


def _reps(results):
    return [b for b in (load("bench.json", results), load("bench_rep2.json", results)) if b]


# ------------------------------------------------------------------ one text per chapter


def _chapter2(results):
    p = load("parity.json", results)
    b = load("bench.json", results)
    ch = load("chapters.json", results)
    lines = [header(p["machine"]), "",
             f"Every engine after {p['steps']} AdamW steps of the nano GPT against one process on the global "
             f"batch (max |difference| over all weights; tolerance fp32 {p['tolerance']['fp32']:g}, "
             f"bf16 {p['tolerance']['bf16']:g}). World 1 runs NCCL; world 2 runs two ranks on the one GPU "
             "over gloo with CUDA tensors (NCCL refuses two ranks on one GPU).", "",
             "| engine | fp32, world 1 | bf16, world 1 | fp32, world 2 | bf16, world 2 |", "|---|---:|---:|---:|---:|"]
    engines = sorted({k.rsplit(" ", 1)[0] for w in p["worlds"].values() for k in w["engines"]},
                     key=lambda e: list(p["worlds"]["1"]["engines"]).index(e + " fp32"))
    for e in engines:
        cells = []
        for n in ("1", "2"):
            for prec in ("fp32", "bf16"):
                r = p["worlds"][n]["engines"].get(f"{e} {prec}")
                cells.append("not run" if r is None else (f"{r['max_abs_diff']:.1e}" + ("" if r["pass"] else " FAIL"))
                             if r.get("ran") else "failed")
        lines.append(f"| {e} | " + " | ".join(cells) + " |")
    lines += ["", f"The same GPU's bf16 matrix product ran at {b['matmul_peak']['flops'] / 1e12:.0f} TFLOP/s "
                  f"({b['matmul_peak']['note']})."]
    c2 = (ch or {}).get("chapters", {}).get("02_mixed_precision.ipynb", {})
    ratio = next((c for c in c2.get("differing_cells", []) if c["head"].startswith("ratios")), None)
    if ratio:
        lines += ["", "This chapter's own step-time comparison, executed once on the GPU box (the model is tiny, so "
                      "the GPU waits on Python and bf16 cannot pay off). One run of the cell, whose steps' spread was "
                      "not kept: read it as bf16 not paying off on a model this small, not as a measured slowdown, "
                      "and not as a difference between the three 16-bit rows.", "",
                  "```", ratio["stdout"].rstrip(), "```"]
    return "\n".join(lines)


def mfu(row, bench) -> float:
    """Model FLOPs utilisation, the book's one convention (zerolab.book.mfu): 6 x (parameters outside the
    embedding lookups) + attention FLOPs per token, times the row's tokens per second, over the datasheet's
    dense bf16 peak (989 TFLOP/s). Computed here from the measured tokens per second and the model's
    configuration: the files' own MFU fields counted the embedding lookups as 6 FLOPs per parameter too
    (and the first ones divided by the measured matmul rate instead of the datasheet's)."""
    return model_flops.mfu(row["tokens_per_s"], bench["runs"]["world1"]["config"], row["psi"])


# Rows of the committed bench files whose memory was measured against a level that moved during their run
# (files written before gpu.workers.bench_worker measured against the level with no engine alive; newer rows
# carry "leftover_bytes" and need nothing). FSDP2 reshard=False came right after PyTorch DDP, whose buffers
# were freed during its run: its "held" fell below its own fp32 parameters and Adam moments (12 bytes per
# parameter), by 1.6 GB in one repetition and 1.2 GB in the other. Two quantities the moving level does not
# touch remain: its peak above its held (the same in both repetitions to 0.01%), and what it holds between
# steps, which at world 1 is the same tensors as FSDP2 reshard=True's (both reshard after backward);
# tests/test_gpu_results.py checks both premises, the second by counting both engines' tensors on a CPU.
MOVED_LEVEL = {"FSDP2 reshard=False": "FSDP2 reshard=True"}


def world1_memory(bench) -> dict:
    """{engine: (held, peak, derived)} at world 1: measured, or re-derived for a MOVED_LEVEL row as its
    twin's held plus its own measured peak-above-held (derived=True)."""
    rows = {k: r for k, r in _rows(bench, "world1").items() if r["ran"]}
    out = {}
    for name, r in rows.items():
        twin = MOVED_LEVEL.get(name)
        if twin in rows and "leftover_bytes" not in r:
            held = rows[twin]["held_bytes"]
            out[name] = (held, held + r["peak_bytes"] - r["held_bytes"], True)
        else:
            out[name] = (r["held_bytes"], r["peak_bytes"], False)
    return out


def _steps(r) -> str:
    return f"{r['step_ms']:.1f} ({r['step_ms_min']:.0f}-{r['step_ms_max']:.0f})"


def _bench_row(r, rep2=None, bench=None, bench2=None):
    ran2 = bool(rep2 and rep2.get("ran"))
    held, peak, derived = world1_memory(bench).get(r["engine"], (r["held_bytes"], r["peak_bytes"], False))
    mark = "†" if derived else ""
    clip = CLIP_MARK if clipped(r["engine"], bench) or (ran2 and clipped(r["engine"], bench2 or bench)) else ""
    tokens = f"{r['tokens_per_s']:,.0f}" + (f" / {rep2['tokens_per_s']:,.0f}" if ran2 else "")
    mfus = f"{100 * mfu(r, bench):.1f}%" + (f" / {100 * mfu(rep2, bench2 or bench):.1f}%" if ran2 else "")
    return (f"| {r['engine']}{clip} | {precision(r['engine'])} | {_steps(r)} | {_steps(rep2) if ran2 else '-'} | "
            f"{tokens} | {mfus} | {_gb(held)}{mark} | {_gb(peak)}{mark} | {_gb(r['formula_model_state_bytes'])} | "
            f"{peak / r['formula_model_state_bytes']:.2f}{mark} |")


BENCH_HEAD = ["| engine | precision | step (ms), rep 1: median (min-max) | rep 2 | tokens/s (rep 1 / rep 2) | "
              "MFU (rep 1 / rep 2) | held (GB) | peak (GB) | formula (GB) | peak / formula |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]


def _bench_intro(b):
    w = b["runs"]["world1"]
    psi = w["rows"][0]["psi"]
    cfg = w["config"]
    return (f"A {psi / 1e6:.0f} M-parameter GPT ({cfg['n_layer']} layers, width {cfg['n_embd']}, "
            f"{cfg['block_size']} tokens, vocabulary {cfg['vocab_size']}) with AdamW, "
            f"{w['batch_per_rank']} sequences a step, eager (no `torch.compile`) on every side, world 1 on NCCL: one "
            "GPU, so no collective moves a byte, and the times compare what each engine costs around the same "
            f"model and batch (hooks, copies, casts, its optimizer, kernel launches), not how it communicates. Buckets of "
            f"{w['bucket_mb']:g} MB; each engine built alone, {w['warmup']} warm-up and {w['timed_steps']} timed steps: "
            "the median, with the fastest and slowest step in brackets, for each of two repetitions on two machine "
            "starts. MFU = the model's FLOPs per token × tokens/s over the H100's datasheet bf16 peak, "
            f"{H100_PEAK_FLOPS / 1e12:.0f} TFLOP/s, with 6 FLOPs per parameter outside the embedding lookups "
            f"({model_flops.embedding_params(cfg) / 1e6:.1f} M of the {psi / 1e6:.0f} M are looked up, not multiplied) "
            f"plus attention: {model_flops.flops_per_token(cfg, psi) / 1e9:.3f} GFLOP per token. The same GPU's "
            f"bf16 matrix product measured {b['matmul_peak']['flops'] / 1e12:.0f} TFLOP/s, "
            f"{100 * b['matmul_peak']['flops'] / H100_PEAK_FLOPS:.0f}% of the peak, above every row. "
            "Held = allocated when a step begins; peak = "
            "`torch.cuda.max_memory_allocated` over the timed steps; formula = the paper's model states for the "
            "engine's layout (activations come on top). Step times of one engine moved by a factor of two or more "
            "between the repetitions for the engines that launch many small kernels: compare engines within a "
            "repetition (one machine start), and read a difference that the two repetitions do not both show as "
            "a tie.\n\n" + PRECISION_NOTE)


def _derived_note(bench, bench2=None) -> str:
    rows, rows2 = _rows(bench, "world1"), (_rows(bench2, "world1") if bench2 else {})
    lines = []
    for name, (held, peak, derived) in world1_memory(bench).items():
        if derived:
            r, r2 = rows[name], rows2.get(name)
            other = (f" ({_gb(r2['held_bytes'])} GB in the second, peak above held "
                     f"{_gb(r2['peak_bytes'] - r2['held_bytes'])} GB there too)" if r2 and r2["ran"] else "")
            lines.append(f"† {name}: re-derived from the raw results, not shown as recorded. The run measured it "
                         "against the allocator's level before it was built, and bytes allocated before then were "
                         f"freed during its run, so it recorded {_gb(r['held_bytes'])} GB held in the first repetition{other}: "
                         "less than its own fp32 parameters and Adam moments, 12 bytes per parameter. Between steps "
                         f"at world 1 it holds the same tensors as {MOVED_LEVEL[name]} ({_gb(held)} GB, measured); its "
                         f"peak is that plus its measured peak above held, {_gb(r['peak_bytes'] - r['held_bytes'])} GB, "
                         "which the moving level does not change. The scripts in gpu/ now measure against the level "
                         "with no engine alive, so a new run needs no such step.")
    return "\n\n".join(lines)


def _psi_words(bench, run):
    return f"{bench['runs'][run]['rows'][0]['psi'] / 1e6:.0f} M-parameter"


def _chapter5(results):
    b1, *rest = _reps(results)
    b2 = rest[0] if rest else None
    prof = load("profile.json", results)
    r1, r2 = _rows(b1, "world1"), (_rows(b2, "world1") if b2 else {})
    lines = [header(b1["machine"]), "", _bench_intro(b1), "", *BENCH_HEAD]
    for name in ("zl.DDP", "PyTorch DDP"):
        lines.append(_bench_row(r1[name], r2.get(name), b1, b2))
    ov = load("overlap.json", results)
    lines += ["", f"This chapter's three DDPs on the GPU ({_psi_words(b1, 'world2')} GPT in bf16, "
                  f"{ov['batch_per_rank']} sequences per rank, 25 MB buckets). "
                  "Hidden = the share of the gradient all-reduces' time that ran before the backward's compute "
                  "ended (the ledger's host clock).", "",
              "| world | DDP | step (ms) | all-reduces | hidden | wait after backward (ms) |",
              "|---|---|---:|---:|---:|---:|"]
    for key in ("world2", "world1"):
        run = ov["ddp"][key]
        backend = "NCCL" if "nccl" in run["backend"] else run["backend"]
        for mode, r in run["rows"].items():
            lines.append(f"| {key[-1]} ({backend}) | {mode} | {r['step_ms']:.1f} | {r['allreduce_calls']} | "
                         f"{100 * r['overlap']:.0f}% | {r['wait_after_backward_ms']:.1f} |")
    lines += ["", "At world 2 the two ranks share one GPU and gloo stages every all-reduce through the host: "
                  "the backward's kernels finish long before the gradients are summed, so overlap hides little "
                  "of the communication, and bucketing (fewer, larger messages) buys more. At world 1 the "
                  "all-reduces are only issued (nothing moves), so 'hidden' there means issued during backward."]
    e = prof["engines"]
    lines += ["", "One profiled step (`torch.profiler`, world 1; the profiler itself slows every step):", "",
              "| engine | GPU span (ms) | GPU busy (ms) | GPU idle (ms) | NCCL kernels |", "|---|---:|---:|---:|---:|"]
    for name in ("zl.DDP", "PyTorch DDP"):
        s = e[name]
        lines.append(f"| {name} | {s['gpu_span_us'] / 1e3:.1f} | {s['compute_busy_us'] / 1e3:.1f} | "
                     f"{s['gpu_idle_us'] / 1e3:.1f} | {s['comm_kernels']} |")
    lines += ["", "With one rank NCCL launches no kernel for an all-reduce (nothing to exchange), so the trace "
                  "cannot show communication overlapping the backward; it shows what each engine costs around "
                  f"it: the GPU sat idle {e['zl.DDP']['gpu_idle_us'] / 1e3:.1f} ms of zl.DDP's step and "
                  f"{e['PyTorch DDP']['gpu_idle_us'] / 1e3:.1f} ms of PyTorch DDP's (under autocast), waiting for "
                  "the CPU to launch work; the profiler's own overhead makes such gaps longer than in the "
                  "timed table above."]
    return "\n".join(lines)


def _chapter8(results):
    b1 = _reps(results)[0]
    w2 = b1["runs"]["world2"]
    lines = [header(b1["machine"]), "",
             f"Per-rank memory at world 2: two ranks share the one GPU over gloo (CUDA tensors; NCCL refuses two "
             f"ranks on one GPU), a {w2['rows'][0]['psi'] / 1e6:.0f} M-parameter GPT in bf16, "
             f"{w2['batch_per_rank']} sequences per rank. Held = allocated bytes when a step begins (gradients "
             "freed by zero_grad); formula = the paper's model states per rank (bf16 parameters and gradients, "
             "K = 12; PyTorch's engines keep fp32 parameters and gradients, K = 8).", "",
             "| engine | held / rank (GB) | formula / rank (GB) | peak / rank (GB) |", "|---|---:|---:|---:|"]
    for r in w2["rows"]:
        if r["ran"]:
            lines.append(f"| {r['engine']} | {_gb(r['held_bytes'])} | {_gb(r['formula_model_state_bytes'])} | "
                         f"{_gb(r['peak_bytes'])} |")
    ov = load("overlap.json", results)
    lines += ["", f"Prefetch, as in this chapter's timing cell but on the GPU: prefetch=0 and prefetch=1 trained "
                  f"side by side on the {_psi_words(b1, 'world2')} GPT in bf16, interleaved step by step "
                  "(median step, and the time each step sat blocked waiting for all-gathers):", "",
              "| world | prefetch=0 step (ms) | blocked (ms) | prefetch=1 step (ms) | blocked (ms) | "
              "prefetch=1 / prefetch=0 |", "|---|---:|---:|---:|---:|---:|"]
    for key in ("world2", "world1"):
        p = ov["prefetch"][key]
        backend = "NCCL" if "nccl" in p["backend"] else p["backend"]
        lines.append(f"| {key[-1]} ({backend}) | {p['step_ms']['0']:.1f} | {p['gather_wait_ms']['0']:.1f} | "
                     f"{p['step_ms']['1']:.1f} | {p['gather_wait_ms']['1']:.1f} | {p['median_ratio_pf1_over_pf0']:.3f} |")
    lines += ["", "One run of 8 interleaved steps per world size; the steps' spread was not kept, so the ratio "
                  "column has none beside it.", "",
              "Over gloo on one GPU an all-gather is far slower than the unit's compute, so prefetch hides "
                  "only part of it; at world 1 an all-gather moves nothing and prefetch changes nothing (the "
                  "bench in chapter 10 shows the same two engines within run-to-run noise of each other)."]
    return "\n".join(lines)


def _chapter9(results):
    m = load("memory_snapshot.json", results)
    c, md = m["cuda"], m["model"]
    t = m["traced_step_cuda"]
    lines = [header(m["machine"]), "",
             f"ZeRO-3 in bf16 with activation checkpointing, world 1 (NCCL), a {m['psi'] / 1e6:.0f} M-parameter GPT: "
             "two steps recorded with `torch.cuda.memory._record_memory_history`, then one step followed op by op "
             "and replayed in `zerolab.theory.allocator` (this chapter's model).", "",
             "| | GiB |", "|---|---:|",
             f"| CUDA: peak allocated | {_gib(c['allocated_peak'])} |",
             f"| CUDA: peak reserved (segments) | {_gib(c['reserved_peak'])} |",
             f"| CUDA: reserved - allocated at the peaks | {_gib(c['fragmentation_peak_bytes'])} "
             f"({100 * c['fragmentation_peak_fraction']:.1f}% of reserved) |",
             f"| CUDA: peak of free pieces inside split segments (inactive_split) | {_gib(c['inactive_split_peak'])} |",
             f"| CUDA after the steps: free inside {c['segments_end']} segments | {_gib(c['free_in_segments_end'])} "
             f"(largest block {_gib(c['largest_free_block_end'])}) |",
             f"| model: the step's peak live bytes (above the {_gib(t['allocated_at_start'])} held before it) | "
             f"{_gib(md['without_MD']['peak_live'])} |",
             f"| model: arena reserved without M_D | {_gib(md['without_MD']['reserved'])} "
             f"({100 * md['without_MD']['fragmentation']:.2f}% fragmentation) |",
             f"| model: reserved with M_D ({md['long_lived_blocks']} long-lived blocks pre-allocated) | "
             f"{_gib(md['with_MD']['reserved'])} ({100 * md['with_MD']['fragmentation']:.1f}%) |", "",
             f"Allocation retries: {c['num_alloc_retries']}, out-of-memory events: {c['num_ooms']}. The model's "
             "best-fit arena packs this step almost perfectly, and M_D's separately sized region raises its "
             "reserve instead of lowering it: in this trace the long-lived blocks strand no free space. The "
             "real caching allocator reserves much more than it allocates (rounding, separate pools per size "
             "class, split blocks whose free pieces fit no later request), which the model does not "
             "represent; on an 80 GB card that slack cost nothing, so nothing was retried or failed."]
    off = load("offload.json", results)
    pc = off["pcie"]
    spread = "step_ms_min" in next(iter(off["runs"]["world1"]["rows"].values()))
    lines += ["", "ZeRO-R's activation options under `zl.ZeRO(stage=2)` in bf16 (peak allocated per rank; the step is "
                  + ("the median of the timed steps, fastest and slowest in brackets" if spread else
                     "the median of 5 timed steps of one run, which kept no per-step times, so no spread is shown, "
                     "neither for a row nor for a ratio of two rows; gpu/offload.py now keeps every step's time. The "
                     "same engine on the same model without "
                     "checkpointing, zl.ZeRO-2 in chapter 10's bench, took "
                     + " and ".join(f"{_rows(b, 'world1')['zl.ZeRO-2']['step_ms']:.1f}" for b in _reps(results))
                     + f" ms in its two repetitions, and {off['runs']['world1']['rows']['no checkpointing']['step_ms']:.1f} "
                     "ms in the first row below")
                  + f"). Pinned copies over PCIe ran at {pc['host_to_device'] / 1e9:.0f} GB/s host to device and "
                  f"{pc['device_to_host'] / 1e9:.0f} GB/s back. World 2 is two tensor-parallel ranks (Mesh dp=1, "
                  "mp=2) sharing the one GPU over gloo, so its step times are gloo's, not a GPU link's.", "",
              "| world | model | option | step (ms) | peak / rank (GB) | offloaded / step / rank (MB) |",
              "|---|---|---|---:|---:|---:|"]
    for key in ("world1", "world2"):
        run = off["runs"][key]
        psi = "406 M" if run["model"] == "350m" else "163 M"
        for name, r in run["rows"].items():
            if r["ok"]:
                backend = "NCCL" if "nccl" in run["backend"] else run["backend"]
                step = f"{r['step_ms']:.1f}" + (f" ({r['step_ms_min']:.0f}-{r['step_ms_max']:.0f})" if spread else "")
                lines.append(f"| {run['world_size']} ({backend}) | {psi} | {name} | {step} | "
                             f"{_gb(r['peak_bytes_per_rank'])} | {r['offloaded_bytes_per_step_per_rank'] / 1e6:.1f} |")
    sent = off["runs"]["world2"]["rows"]["P_a+cpu (offload)"]["offloaded_bytes_per_step_per_rank"]
    lines += ["", f"P_a needs a model-parallel group, so it runs at world 2 only. {sent / 1e6:.0f} MB offloaded a "
                  f"step at the measured {pc['device_to_host'] / 1e9:.0f} GB/s is {1e3 * sent / pc['device_to_host']:.1f} ms "
                  "each way (computed from those two numbers), lost in a gloo-bound step."]
    return "\n".join(lines)


def _chapter10(results):
    b1, *rest = _reps(results)
    b2 = rest[0] if rest else None
    r2 = _rows(b2, "world1") if b2 else {}
    lines = [header(b1["machine"]), "", _bench_intro(b1), "",
             f"DeepSpeed: {b1['deepspeed']}, installed from its source distribution with no compiled ops, "
             "torch.optim.AdamW as its optimizer, bf16, reduce/all-gather buckets of 25 MB, overlap_comm on. "
             "At world 1 zerolab's three ZeRO stages hold the same (there is nothing to shard; FSDP2 and "
             "DeepSpeed ZeRO-3 keep other buffers): chapter 8's table shows the per-rank savings at world 2.", "", *BENCH_HEAD]
    for r in b1["runs"]["world1"]["rows"]:
        if r["ran"]:
            lines.append(_bench_row(r, r2.get(r["engine"]), b1, b2))
        else:
            lines.append(f"| {r['engine']} | {precision(r['engine'])} | not run: {r['error'][:80]} | | | | | | | |")
    note = _derived_note(b1, b2)
    clip = CLIP_NOTE if any(clipped(r["engine"], b) for b in (b1, b2) if b for r in b["runs"]["world1"]["rows"]) else ""
    return "\n".join(lines + [x for n in (clip, note) if n for x in ("", n)])


TEXT = {2: _chapter2, 5: _chapter5, 8: _chapter8, 9: _chapter9, 10: _chapter10,
        11: lambda results: later.chapter11(results or RESULTS, load("chapters.json", results), load("bench.json", results)),
        12: lambda results: later.chapter12(load("chapters.json", results)),
        13: lambda results: later.chapter13(load("offload_cuda.json", results), results)}


def facts(chapter: int, results: str | None = None) -> dict:
    """The few numbers a chapter's prose quotes from the GPU results, computed from the files
    (so the text and the table below it cannot disagree); {} when the files are not there."""
    if missing(results):
        return {}
    if chapter == 8:
        p = load("overlap.json", results)["prefetch"]["world2"]
        w0, w1 = p["gather_wait_ms"]["0"], p["gather_wait_ms"]["1"]
        return {"blocked_pf0_ms": w0, "blocked_pf1_ms": w1, "blocked_cut": 1 - w1 / w0}
    if chapter == 10:
        b1, b2 = _reps(results)[:2]
        r1, r2 = _rows(b1, "world1"), _rows(b2, "world1")
        moves = [max(a["tokens_per_s"], b["tokens_per_s"]) / min(a["tokens_per_s"], b["tokens_per_s"])
                 for name, a in r1.items() for b in [r2.get(name)] if a["ran"] and b and b["ran"]]
        return {"psi": b1["runs"]["world1"]["rows"][0]["psi"], "largest_move": max(moves)}
    if chapter == 11:
        runs = later.h200_runs(os.path.join(results or RESULTS, later.H200_RUN))
        meta = load(later.H200_JSON, os.path.join(results or RESULTS, later.H200_RUN))
        return {"runs": runs, "stages": later.stage_ratios(runs), "compile": later.compile_effect(runs),
                "machine": meta["machine"]}
    raise ValueError(f"no GPU facts for chapter {chapter!r}; chapters with some: 8, 10, 11")


def missing(results: str | None = None) -> list[str]:
    """The result files that are not there (the GPU results are optional: a checkout may lack them)."""
    return [f for f in FILES + LOGS if not os.path.exists(os.path.join(results or RESULTS, f))]


def markdown(chapter: int, results: str | None = None) -> str:
    """The chapter's 'measured on a GPU' text (Markdown), from the committed files only."""
    if chapter not in TEXT:
        raise ValueError(f"no GPU result for chapter {chapter!r}; chapters with one: {CHAPTERS}")
    gone = missing(results)
    if gone:
        return (f"No GPU results here ({', '.join(gone)} missing under {results or RESULTS}): "
                "see README, 'Reproduce the GPU results'.")
    return TEXT[chapter](results)


def figure(chapter: int, results: str | None = None) -> str | None:
    """The path of the chapter's committed figure, or None."""
    name = FIGURES.get(chapter)
    path = os.path.join(results or RESULTS, name) if name else None
    return path if path and os.path.exists(path) else None


def show(chapter: int, results: str | None = None, with_figure: bool = True) -> None:
    """Display the chapter's GPU table (and figure) in a notebook; print it elsewhere.

    with_figure=False leaves the figure to show_figure, so a chapter can give it a cell (and a
    numbered caption) of its own."""
    text = markdown(chapter, results)
    if text.startswith("No GPU results here"):
        print(text)
        return
    try:
        from IPython.display import Markdown, display
    except ImportError:
        print(text)
        return
    display(Markdown(text))
    if with_figure:
        show_figure(chapter, results)


def show_figure(chapter: int, results: str | None = None) -> None:
    """Display the chapter's committed GPU figure, if it has one."""
    fig = figure(chapter, results)
    if fig:
        from IPython.display import Image, display
        display(Image(filename=fig))
