"""The committed GPU results (gpu/results/, written by gpu/run_all.sh on a GPU box) on a CPU.

Nothing here needs or touches a GPU: the files must parse, name the machine, the date and the
library versions, render for every chapter that shows them, and obey physics that the
measurement did not assume (sharding lowers per-rank memory by the paper's amounts, MFU is a
fraction, the op-level allocation tracker agrees with the CUDA allocator).
"""

import json
import os
import re

import pytest

import zerolab.book.gpu_results as gr
import zerolab.book.gpu_results_ch11_13 as ch11
from zerolab.book import mfu

RESULTS = gr.RESULTS
pytestmark = pytest.mark.skipif(bool(gr.missing()), reason="no GPU results in this checkout")


def load(name):
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


@pytest.mark.parametrize("name", gr.FILES)
def test_every_file_names_the_machine_date_and_versions(name):
    m = load(name)["machine"]
    assert "NVIDIA" in m["device"] and m["device_count"] >= 1
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", m["date"])
    for key in ("torch", "cuda", "nccl", "driver", "python"):
        assert m[key], key
    assert "+cu" in m["torch"], "a CUDA build of PyTorch"


def test_the_csv_files_hold_the_json_rows():
    import csv
    for stem in ("bench", "bench_rep2"):
        with open(os.path.join(RESULTS, stem + ".csv")) as f:
            rows = list(csv.DictReader(f))
        js = load(stem + ".json")
        assert len(rows) == sum(len(e["rows"]) for e in js["runs"].values())


@pytest.mark.parametrize("chapter", gr.CHAPTERS)
def test_show_renders_for_every_chapter(chapter, capsys):
    text = gr.markdown(chapter)
    first = text.splitlines()[0]
    assert first.startswith("**Measured on a GPU (NVIDIA") and re.search(r"\d{4}-\d{2}-\d{2}", first)
    assert "|---" in text                                         # a table
    assert gr.markdown(chapter) == text                           # the same text every time (nbval)
    gr.show(chapter)
    if chapter in gr.FIGURES:
        assert gr.figure(chapter) and os.path.getsize(gr.figure(chapter)) < 300_000


def test_show_says_so_when_the_files_are_missing(tmp_path, capsys):
    gr.show(10, results=str(tmp_path))
    out = capsys.readouterr().out
    assert out.startswith("No GPU results here") and "Reproduce the GPU results" in out
    with pytest.raises(ValueError, match="chapters with one"):
        gr.markdown(3)


def test_gpu_folder_stays_small():
    root = os.path.dirname(RESULTS)
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs
                if "__pycache__" not in d)
    assert total < 3_000_000


# ------------------------------------------------------------------ physics


def test_every_engine_matches_one_process_on_the_gpu():
    p = load("parity.json")
    assert "nccl" in p["worlds"]["1"]["backend"] and p["worlds"]["2"]["backend"] == "gloo"
    for n in ("1", "2"):
        assert p["worlds"][n]["device"].startswith("cuda")
        engines = p["worlds"][n]["engines"]
        assert len(engines) == 10
        for key, r in engines.items():
            assert r["ran"] and r["pass"], (n, key)
            assert r["max_abs_diff"] <= p["tolerance"][key.rsplit(" ", 1)[1]]
    # at world 1 nothing is reduced: every engine is the single process, bit for bit
    assert all(r["max_abs_diff"] == 0 for r in p["worlds"]["1"]["engines"].values())


@pytest.mark.parametrize("name", ["bench.json", "bench_rep2.json"])
def test_bench_rows_are_physical(name):
    b = load(name)
    peak = b["matmul_peak"]["flops"]
    assert 1e14 < peak < 2e15, "an H100-class bf16 matmul rate"
    for run in ("world1", "world2"):
        for r in b["runs"][run]["rows"]:
            assert r["ran"], r["engine"]
            assert 0 < r["held_bytes"] < r["peak_bytes"] < 80e9
            if run == "world1":
                assert 0 < gr.mfu(r, b) < peak / 989e12       # no engine passes the measured matmul rate
                # the FLOPs behind MFU, from the step time: 6 per parameter outside the embeddings, and attention
                tokens = b["runs"][run]["tokens_per_step"]
                cfg = b["runs"][run]["config"]
                assert r["tokens_per_s"] == pytest.approx(tokens / (r["step_ms"] / 1e3))
                assert gr.mfu(r, b) * 989e12 >= 6 * (r["psi"] - mfu.embedding_params(cfg)) * r["tokens_per_s"]
                assert r["step_ms_min"] <= r["step_ms"] <= r["step_ms_max"]


@pytest.mark.parametrize("name", ["bench.json", "bench_rep2.json"])
def test_sharding_lowers_per_rank_memory_by_the_papers_amounts(name):
    rows = {r["engine"]: r for r in load(name)["runs"]["world2"]["rows"]}
    psi, n = rows["zl.DDP"]["psi"], 2
    held = {k: r["held_bytes"] for k, r in rows.items()}
    assert held["zl.ZeRO-3"] < held["zl.ZeRO-1"] < held["zl.DDP"]
    assert held["zl.ZeRO-2"] == pytest.approx(held["zl.ZeRO-1"], rel=0.01)   # gradients freed: the same between steps
    assert held["FSDP2 reshard=True"] < held["PyTorch DDP"]
    # between steps the gradients are freed (zero_grad), so what is held is the paper's model
    # states minus the gradients: DDP 2 + 12 (plus its 2-byte gradient buffer), ZeRO-1 2 + 12/N,
    # ZeRO-2 2 + 12/N, ZeRO-3 (2 + 12)/N bytes per parameter
    expect = {"zl.DDP": 16 * psi, "zl.ZeRO-1": (2 + 12 / n) * psi, "zl.ZeRO-2": (2 + 12 / n) * psi,
              "zl.ZeRO-3": 14 / n * psi, "PyTorch DDP": 16 * psi, "FSDP2 reshard=True": 12 / n * psi}
    for k, want in expect.items():
        assert held[k] == pytest.approx(want, rel=0.05), k


def test_the_op_level_tracker_agrees_with_the_cuda_allocator():
    m = load("memory_snapshot.json")
    c, t, model = m["cuda"], m["traced_step_cuda"], m["model"]
    assert c["allocated_peak"] <= c["reserved_peak"]
    assert c["fragmentation_peak_bytes"] == c["reserved_peak"] - c["allocated_peak"]
    assert 0 <= c["inactive_split_peak"] <= c["fragmentation_peak_bytes"]
    # held before the traced step + the step's peak live bytes (counted op by op, zerolab.memory)
    # = the CUDA allocator's peak for that step
    assert t["allocated_at_start"] + model["without_MD"]["peak_live"] == pytest.approx(t["allocated_peak"], rel=0.02)
    assert model["without_MD"]["reserved"] >= model["without_MD"]["peak_live"]


def test_every_chapter_ran_on_the_gpu_box():
    ch = load("chapters.json")["chapters"]
    assert len(ch) == 13
    # a chapter that stopped there carries the error it stopped at (the book says so)
    assert all(c["ok"] or c.get("error") for c in ch.values())
    assert [name for name, c in ch.items() if not c["ok"]] == ["13_offload.ipynb"]


def test_fast_path_rows_are_physical():
    fast = load("fastpath.json")
    for run in fast["runs"].values():
        for r in run["rows"]:
            if not r["ok"]:
                continue
            assert r["tokens_per_s"] == pytest.approx(8 * 1024 / (r["step_ms"] / 1e3))
            assert r["step_ms_min"] <= r["step_ms"] <= r["step_ms_max"]
            assert 0.05 < r["mfu_datasheet"] < 0.8        # no engine passes the measured matmul rate
            assert r["peak_bytes"] > r["formula_model_state_bytes"]    # activations come on top
    compiled = {r["engine"]: r for r in fast["runs"]["compiled"]["rows"] if r["ok"]}
    eager = {r["engine"]: r for r in fast["runs"]["eager"]["rows"] if r["ok"]}
    # compiling costs seconds in the first step, whoever compiles
    assert compiled["zl.DDP compiled"]["warmup_s"][0] > 10 * eager["zl.DDP"]["warmup_s"][0]


def test_offload_on_cuda_moves_the_closed_form_and_the_upload_runs_at_the_bus_rate():
    off = load("offload_cuda.json")
    for run in off["runs"].values():
        for r in run["rows"]:
            if r["ok"] and r["offload"] and r["engine"].startswith("zl."):
                for step in r["transfers"]:           # bf16 gradient down, bf16 parameters up: 2 Psi each
                    assert step["d2h"][0] == step["h2d"][0] == 2 * r["psi"]
    first = [r for r in off["runs"]["first"]["rows"] if r["ok"] and r["offload"] and r["engine"].startswith("zl.")]
    second = [r for r in off["runs"]["second"]["rows"] if r["ok"] and r["offload"] and r["engine"].startswith("zl.")]
    rate = off["runs"]["second"]["pcie"]["host_to_device"]
    for r in second:                                  # converting first: within 2x of the bus
        assert r["transfers"][-1]["h2d"][1] < 2 * (2 * r["psi"] / rate)
    for r in first:                                   # converting inside the copy: 10x or more
        assert r["transfers"][-1]["h2d"][1] > 10 * (2 * r["psi"] / rate)


def test_checkpointing_and_offload_lower_the_peak_and_offload_moves_bytes():
    off = load("offload.json")
    assert 1e9 < off["pcie"]["host_to_device"] < 200e9 and 1e9 < off["pcie"]["device_to_host"] < 200e9
    for key in ("world1", "world2"):
        rows = off["runs"][key]["rows"]
        assert all(r["ok"] for r in rows.values())
        assert rows["checkpointing"]["peak_bytes_per_rank"] < rows["no checkpointing"]["peak_bytes_per_rank"]
        assert rows["checkpointing"]["step_ms"] > rows["no checkpointing"]["step_ms"]   # the recompute
    w2 = off["runs"]["world2"]["rows"]
    assert w2["P_a+cpu (offload)"]["offloaded_bytes_per_step_per_rank"] > 0
    assert w2["P_a"]["offloaded_bytes_per_step_per_rank"] == 0
    assert w2["P_a+cpu (offload)"]["peak_bytes_per_rank"] < w2["P_a"]["peak_bytes_per_rank"] \
        < w2["checkpointing"]["peak_bytes_per_rank"]


def test_buckets_and_overlap_and_prefetch_act_as_the_chapters_say():
    ov = load("overlap.json")
    for key in ("world1", "world2"):
        rows = ov["ddp"][key]["rows"]
        assert rows["bucketed"]["allreduce_calls"] < rows["naive"]["allreduce_calls"]
        assert rows["naive"]["overlap"] == 0 and rows["bucketed"]["overlap"] == 0   # both wait for backward's end
        assert rows["overlapped"]["overlap"] > 0
    w2 = ov["ddp"]["world2"]["rows"]
    # where communication is real (gloo): fewer messages and overlap each shorten the wait
    assert w2["overlapped"]["wait_after_backward_ms"] < w2["bucketed"]["wait_after_backward_ms"] \
        < w2["naive"]["wait_after_backward_ms"]
    p2 = ov["prefetch"]["world2"]
    assert p2["gather_wait_ms"]["1"] < p2["gather_wait_ms"]["0"]
    assert ov["prefetch"]["world1"]["gather_wait_ms"]["0"] < 1.0      # NCCL at world 1: nothing to wait for


def test_mfu_counts_six_flops_per_parameter_outside_the_embedding_lookups():
    # one definition of MFU in the book (zerolab.book.mfu): the model's FLOPs per token, 6 per parameter that a
    # matrix product multiplies (not the token and position tables, which are looked up) plus PaLM's attention
    # term 12 L T d, times tokens/s, over the datasheet's 989 TFLOP/s
    b = load("bench.json")
    cfg = b["runs"]["world1"]["config"]
    psi = b["runs"]["world1"]["rows"][0]["psi"]
    V, T, d, L = cfg["vocab_size"], cfg["block_size"], cfg["n_embd"], cfg["n_layer"]
    assert not cfg["tie_weights"]                                   # the head multiplies: it counts
    assert mfu.embedding_params(cfg) == V * d + T * d == 52_559_872
    assert mfu.flops_per_token(cfg, psi) == 6 * (psi - V * d - T * d) + 12 * L * T * d == 2_424_926_208
    assert 6 * psi + 12 * L * T * d == 2_740_285_440                 # the count with the lookups, 13% more
    # the same count for a tied model keeps the table once (it is the head's matrix)
    assert mfu.embedding_params({**cfg, "tie_weights": True}) == T * d
    # the tables: zl.DDP at 29.1% and 29.9% in the two repetitions, and every row is tokens/s x that count / peak
    for name, want in (("bench.json", 0.291), ("bench_rep2.json", 0.299)):
        bench = load(name)
        rows = {r["engine"]: r for r in bench["runs"]["world1"]["rows"]}
        assert round(gr.mfu(rows["zl.DDP"], bench), 3) == want
        for r in rows.values():
            assert gr.mfu(r, bench) == pytest.approx(r["tokens_per_s"] * 2_424_926_208 / 989e12)
            # what the run recorded (the same FLOPs over its measured matmul rate, lookups included) differs only
            # by the two conventions: the peak it divided by, and the 6 FLOPs per looked-up parameter
            recorded = r["mfu"] * bench["matmul_peak"]["flops"] / 989e12
            assert gr.mfu(r, bench) == pytest.approx(recorded * 2_424_926_208 / 2_740_285_440, rel=1e-9)
    assert "datasheet bf16 peak" in gr._chapter10(None) and "2.425 GFLOP per token" in gr._chapter10(None)
    assert "29.1% / 29.9%" in gr.markdown(10) and "29.1% / 29.9%" in gr.markdown(5)


@pytest.mark.parametrize("tied", [False, True])
def test_the_roofline_counts_the_same_flops_as_mfu_but_the_biases_and_layernorms(tied):
    # the roofline (zerolab.theory.roofline.count_step, chapter 10) counts every matrix product and attention
    # op by op; MFU's closed form is that count plus 6 FLOPs per token for each 1-D parameter (biases, LayerNorm),
    # which no matrix product multiplies but both papers keep in N
    from functools import partial
    import torch
    from zerolab.models import GPT, GPTConfig, gpt_loss
    from zerolab.theory import roofline as rl
    cfg = GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=4, n_embd=64, tie_weights=tied)
    rows = 3
    with torch.device("meta"):
        model = GPT(cfg).to(torch.bfloat16)
        x = torch.randint(0, 96, (rows, 32))
    c = rl.count_step(model, lambda m, b: gpt_loss(m, b)[1], (x, x), partial(torch.optim.AdamW, foreach=True))
    psi = sum(p.numel() for p in model.parameters())
    assert mfu.embedding_params(cfg) == model.pos_emb.weight.numel() + (0 if tied else model.tok_emb.weight.numel())
    one_d = sum(p.numel() for p in model.parameters() if p.dim() == 1)
    assert c.total("matmul") + c.total("attention") == (mfu.flops_per_token(cfg, psi) - 6 * one_d) * rows * 32


def test_gpu_rows_say_their_precision_and_deepspeeds_clipping():
    # PyTorch DDP ran autocast over fp32 parameters; every committed DeepSpeed row ran with its default clipping
    for chapter in (5, 10, 11):
        text = gr.markdown(chapter)
        assert "| PyTorch DDP | fp32 weights, autocast bf16 |" in text
        for line in (x for x in text.splitlines() if x.count("|") > 8):      # the bench's and the fast path's rows
            if line.startswith("| zl."):
                assert "| bf16 weights, fp32 master |" in line
            if line.startswith("| DeepSpeed"):
                assert line.split(" | ")[0].endswith(gr.CLIP_MARK), line
        assert (gr.CLIP_NOTE in text) == (chapter != 5)
    assert gr.clipped("DeepSpeed ZeRO-1", {}) and not gr.clipped("DeepSpeed ZeRO-1", {"deepspeed_gradient_clipping": 0.0})
    assert not gr.clipped("zl.ZeRO-1", {})


def test_chapter_11_compares_engines_of_one_machine_start_in_both_repetitions():
    folder = os.path.join(RESULTS, ch11.H200_RUN)
    runs = ch11.h200_runs(folder)
    assert set(runs) == {(m, k) for m in ch11.MODES for k in ch11.REPS}
    assert all(len(runs["eager", k]) == 10 and len(runs["compiled", k]) == 7 for k in ch11.REPS)
    # the logs' medians are the JSON's, for the one run whose JSON came back
    js = {r["engine"].removesuffix(" compiled"): r for r in json.load(open(os.path.join(folder, ch11.H200_JSON)))["rows"]}
    for name, r in runs["compiled", 1].items():
        assert r["step_ms"] == pytest.approx(js[name]["step_ms"], abs=0.05)
        assert r["tokens_per_s"] == pytest.approx(js[name]["tokens_per_s"], abs=0.5)
        assert r["first_s"] == pytest.approx(js[name]["warmup_s"][0], abs=0.05)
    for rows in runs.values():                       # tokens per second is the step's 8,192 tokens over its time
        for r in rows.values():
            assert r["tokens_per_s"] == pytest.approx(8192 / (r["step_ms"] / 1e3), rel=1e-3)
    stages = ch11.stage_ratios(runs)
    for s in stages:
        if s["peer"]:
            assert [round(x, 2) for x in s["ratios"]] == [round(p / z, 2) for z, p in zip(s["zerolab_ms"], s["peer_ms"])]
            assert s["verdict"] == ("ahead" if min(s["ratios"]) > 1 else "behind" if max(s["ratios"]) < 1 else "tie")
    zero1 = next(s for s in stages if s["stage"] == "ZeRO-1" and s["mode"] == "eager")
    assert zero1["peer"] == "DeepSpeed ZeRO-1" and [round(x, 2) for x in zero1["ratios"]] == [2.08, 2.11]
    text = gr.markdown(11)
    assert "NVIDIA H200" in text.splitlines()[0] and "machine start" in text and "second machine start" not in text
# ------------------------------------------------------------------ FSDP2's memory, re-derived


def test_the_fsdp2_rederivation_rests_on_what_the_raw_results_show():
    # FSDP2 reshard=False at world 1 recorded less than its own fp32 parameters and Adam moments (12 bytes per
    # parameter) in both repetitions, while reshard=True, the same tensors between steps, recorded 12 Psi; the
    # peak above held, which a moved allocator level cannot change, is the same in both repetitions, and exceeds
    # reshard=True's by the bf16 parameters kept from forward to backward (2 Psi)
    increments = []
    for name in ("bench.json", "bench_rep2.json"):
        rows = {r["engine"]: r for r in load(name)["runs"]["world1"]["rows"]}
        f, t = rows["FSDP2 reshard=False"], rows["FSDP2 reshard=True"]
        psi = f["psi"]
        assert f["held_bytes"] < 12 * psi < t["held_bytes"] < 12.01 * psi
        inc_f, inc_t = f["peak_bytes"] - f["held_bytes"], t["peak_bytes"] - t["held_bytes"]
        assert inc_f - inc_t == pytest.approx(2 * psi, rel=0.01)
        increments.append(inc_f)
    assert increments[0] == pytest.approx(increments[1], rel=1e-4)
    b = load("bench.json")
    rows = {r["engine"]: r for r in b["runs"]["world1"]["rows"]}
    mem = gr.world1_memory(b)
    twin = rows["FSDP2 reshard=True"]["held_bytes"]
    assert mem["FSDP2 reshard=False"] == (twin, twin + increments[0], True)
    assert [k for k, (_, _, derived) in mem.items() if derived] == ["FSDP2 reshard=False"]
    # a row written by the fixed gpu/ (it carries leftover_bytes) is shown as measured
    fixed = {**b, "runs": {**b["runs"], "world1": {**b["runs"]["world1"], "rows": [
        {**r, "leftover_bytes": 0} for r in b["runs"]["world1"]["rows"]]}}}
    assert not any(derived for _, _, derived in gr.world1_memory(fixed).values())
    assert "re-derived" in gr.markdown(10) and "4.88†" in gr.markdown(10)


def fsdp2_states_worker(root):
    """FSDP2 with and without resharding after forward, trained 2 steps on one CPU rank: the model states
    each holds between steps, counted storage by storage (gpu.common.state_bytes)."""
    import sys
    sys.path.insert(0, root)
    import torch
    from gpu.common import bench_cfg, state_bytes, token_batch
    from gpu.workers.engines import peer
    from zerolab.models import GPT, gpt_loss
    cfg, out = bench_cfg("cpu-test"), {}
    for name in ("FSDP2 reshard=False", "FSDP2 reshard=True"):
        torch.manual_seed(0)
        model = GPT(cfg)
        out["psi"], out["tensors"] = sum(p.numel() for p in model.parameters()), len(list(model.parameters()))
        m, opt, _ = peer(name, model, 25.0, torch.device("cpu"))
        for s in range(2):
            _, loss = gpt_loss(m, token_batch(cfg, s, 2, 0, 1, torch.device("cpu")))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        out[name] = state_bytes(module=m, optimizer=opt)
    return out


@pytest.mark.slow
def test_fsdp2_holds_the_same_states_between_steps_whatever_it_reshards():
    # the premise of the re-derivation, counted: at world 1 both FSDP2 settings hold fp32 parameters and AdamW's
    # two moments between steps (12 bytes per parameter, plus one 4-byte step counter per tensor)
    import zerolab as zl
    out = zl.launch(fsdp2_states_worker, 1, args=(os.path.dirname(os.path.dirname(RESULTS)),))[0]
    psi, tensors = out["psi"], out["tensors"]
    assert out["FSDP2 reshard=False"] == out["FSDP2 reshard=True"]
    assert 12 * psi <= out["FSDP2 reshard=False"] <= 12 * psi + 8 * tensors
