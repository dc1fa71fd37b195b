"""The offloaded host step beside DeepSpeed's CPU-Adam and torch's AdamW, on the same tensors.

    python -m gpu.host_step [OUTDIR] [--device cpu|cuda] [--tiny] [--deepspeed] [--repeats 5]
                            [--threads T] [--deadline 60] [--batch B] [--seq T]

OUTDIR defaults to gpu/results/new; the script writes OUTDIR/host_step.json (and host_step.jsonl,
a line per figure as it is taken) and prints every figure as it goes, then a table.

World 1 (NCCL on a GPU, gloo on a CPU), the ~163 M GPT of gpu.bench (--tiny: a 2-layer GPT of
~0.2 M, to try the script) in bf16, zl.ZeRO(stage=2, offload="optimizer") with torch's
AdamW(lr=3e-4); each backward on --batch sequences of --seq tokens (on a GPU 8 x 1,024, as
gpu.offload_cuda; on a CPU 1 x 8: the step's cost does not depend on the batch, and a CPU's
bf16 matrix products would take minutes). Rows, taken in turn (A B C ... A B C ...), one warm-up
round then --repeats rounds:

    zl step, foreach | fused    engine.step() after a backward: gradients down, cast to fp32, the
                                update on the host, the cast to bf16, parameters up, the all-gather
                                (the optimizer's groups switched between foreach and fused=True
                                between rows: one engine, the same tensors). Split into the update
                                inside it (timed between the engine's step hooks), the bus copies
                                (engine.transfers) and the rest (the two casts, the finite check,
                                the all-gather's copy; the collective's own seconds, engine.comm,
                                left out). On a GPU box the host's work is the update and the casts.
    AdamW foreach | fused       torch's AdamW alone on flat fp32 tensors of the sizes of the
                                engine's host shards (one tensor per shard)
    DeepSpeedCPUAdam            (--deepspeed) DeepSpeed's compiled CPU Adam (adamw_mode) alone on
                                those same tensors; and with the cast of each updated shard into a
                                bf16 buffer: its ZeRO-2 offload's host work per step (DeepSpeed
                                casts the gradient to fp32 on the GPU and copies 4 bytes down, so
                                only this cast is the host's; deepspeed/runtime/zero/stage_1_and_2.py)
    cast bf16 -> fp32 | fp32 -> bf16   the two casts alone, on the host, on the same sizes
    GPU cast + fp32 copy down   (GPU) the other way down: cast on the GPU, 4 bytes over the bus,
                                beside "bf16 copy down + host cast" (zerolab's: 2 bytes, then the host)
    DeepSpeed ZeRO-2 offload    (GPU and --deepspeed) DeepSpeed's engine with offload_optimizer on
                                the same model: its step() after its backward (its gradients went
                                down during that backward), and its whole iteration beside zerolab's

Every row: median, min and max over the rounds after the warm-up. The host's threads are set once
for all rows (--threads, default every core this process may run on; OMP_NUM_THREADS too, for
DeepSpeed's OpenMP loop): zl.launch gives each rank one thread, which would starve the update.
With --deepspeed its CPU-Adam op is built (JIT, ninja) before anything else: about a minute the
first time on a GPU box, seconds from its cache after. No new round starts --deadline seconds
(default 60) after that; what was measured is written either way. On a GPU box the rest takes
about a minute. (On a shared machine, time with --threads 1: an OpenMP loop whose other threads
are preempted waits for them at its barrier, once per tensor the optimizer updates.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from functools import partial

import torch

import zerolab as zl
from gpu.common import bench_cfg, compute_device, machine
from zerolab.models import GPT, gpt_loss

LR = 3e-4


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def set_group_path(optimizer, fused: bool) -> None:
    """torch's AdamW reads its groups' `fused` / `foreach` at every step: one optimizer (one state)
    serves both rows (on the host, both keep the step count in a CPU tensor)."""
    for g in optimizer.param_groups:
        g["fused"], g["foreach"] = (True, False) if fused else (False, None)


def time_update_inside(optimizer) -> dict:
    """box["seconds"]: the optimizer's own update inside engine.step(), between the engine's step
    hooks (its pre-hook hands the gradients out, its post-hook sends the weights up)."""
    box = {"seconds": float("nan")}

    def pre(opt, args, kwargs):         # registered after the engine's: runs after it
        box["t0"] = time.perf_counter()

    def post(opt, args, kwargs):
        box["seconds"] = time.perf_counter() - box["t0"]

    optimizer.register_step_pre_hook(pre)
    handle = optimizer.register_step_post_hook(post)
    optimizer._optimizer_step_post_hooks.move_to_end(handle.id, last=False)   # before the engine's
    return box


def build_deepspeed_op() -> dict:
    """Build (or load from the cache) DeepSpeed's CPU-Adam op, here in the parent, so the rank only
    loads it. DeepSpeed 0.19.8's op builder cannot parse an arch list like "9.0a" (a GPU image may
    set one): it gets the GPU's own, "9.0" on an H100 or H200 (the rank inherits it)."""
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if torch.cuda.is_available():
        os.environ["TORCH_CUDA_ARCH_LIST"] = "%d.%d" % torch.cuda.get_device_capability(0)
    t0 = time.perf_counter()
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder
        CPUAdamBuilder().load()
        return {"ok": True, "seconds": time.perf_counter() - t0, "arch_list_before": arch}
    except Exception as e:  # noqa: BLE001 - reported, the rest runs without it
        return {"ok": False, "seconds": time.perf_counter() - t0, "arch_list_before": arch,
                "error": f"{type(e).__name__}: {e}"[:800]}


def deepspeed_engine(model, batch):
    import deepspeed
    from zerolab.bench import deepspeed_config
    from zerolab.bench.peers import quiet_deepspeed
    quiet_deepspeed()
    cfg = deepspeed_config(2, batch, None, bf16=True, overlap=True, adamw_lr=LR, offload_optimizer=True)
    eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return eng


def tokens(cfg, rnd, batch, seq, dev):
    """`batch` sequences of `seq` tokens (the model keeps its block_size: the same parameters)."""
    g = torch.Generator().manual_seed(1000 + rnd)
    x = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g)
    return x[:, :-1].to(dev), x[:, 1:].to(dev)


def host_step_worker(opts: dict, jsonl: str) -> dict:
    torch.set_num_threads(opts["threads"])      # (zl.launch set one thread per rank)
    dev = compute_device() if opts["device"] == "cuda" else torch.device("cpu")
    gpu = dev.type == "cuda"
    cfg = bench_cfg("cpu-test" if opts["tiny"] else "124m")
    batch, seq, deadline = opts["batch"], opts["seq"], opts["deadline_at"]
    out = {"threads": torch.get_num_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
           "device": str(dev), "zerolab": os.path.dirname(zl.__file__), "rows": {}, "errors": {}}

    def note(name, seconds, rnd):
        out["rows"].setdefault(name, []).append(seconds)
        with open(jsonl, "a") as f:
            f.write(json.dumps({"row": name, "round": rnd, "seconds": seconds}) + "\n")
        print(f"round {rnd} {name:<46} {seconds * 1e3:9.1f} ms", flush=True)

    def timed(name, rnd, fn):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        note(name, time.perf_counter() - t0, rnd)

    torch.manual_seed(0)
    model = GPT(cfg).to(dev)
    out["psi"] = sum(p.numel() for p in model.parameters())
    eng = zl.ZeRO(model, partial(torch.optim.AdamW, lr=LR), stage=2, precision="bf16", offload="optimizer",
                  track_peak=False, track_activations=False)
    shards = [m.numel() for m in eng.masters]
    out.update(shards=shards, host_bytes_before_first_step=eng.memory_report()["host"])
    print(f"zerolab from {out['zerolab']}: {out['psi'] / 1e6:.1f} M parameters, {len(shards)} host shards, "
          f"{out['threads']} threads", flush=True)

    # flat fp32 tensors of the shards' sizes, for the optimizers and casts alone (pinned on a GPU box)
    g = torch.Generator().manual_seed(1)
    flat = [torch.nn.Parameter(torch.randn(n, generator=g) * 0.02) for n in shards]
    for p in flat:
        p.grad = torch.empty(p.shape, pin_memory=gpu).copy_(torch.randn(p.shape, generator=g) * 1e-3)
    bf16 = [torch.empty(n, dtype=torch.bfloat16, pin_memory=gpu).copy_(p.grad) for n, p in zip(shards, flat)]
    on_gpu = [b.to(dev) for b in bf16] if gpu else None
    torch_adamw = torch.optim.AdamW(flat, lr=LR)
    ds_adam = ds_eng = None
    if opts["deepspeed"] and opts["deepspeed_op"]["ok"]:
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam
            ds_adam = DeepSpeedCPUAdam(flat, lr=LR, adamw_mode=True)
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            out["errors"]["DeepSpeedCPUAdam"] = f"{type(e).__name__}: {e}"[:500]
        if gpu:
            try:
                torch.manual_seed(0)
                ds_eng = deepspeed_engine(GPT(cfg).to(dev), batch)
            except Exception as e:  # noqa: BLE001
                out["errors"]["DeepSpeed engine"] = f"{type(e).__name__}: {e}"[:500] + traceback.format_exc()[-800:]
    for what, error in out["errors"].items():
        print(f"{what}: NOT available: {error}", flush=True)

    inside = time_update_inside(eng.optimizer)

    def zl_row(fused, rnd):
        path = "fused" if fused else "foreach"
        set_group_path(eng.optimizer, fused)
        t0 = time.perf_counter()
        _, loss = gpt_loss(eng, tokens(cfg, rnd, batch, seq, dev))
        eng.backward(loss)
        sync(dev)
        eng.transfers.reset()
        eng.comm.reset()
        t1 = time.perf_counter()
        eng.step()
        sync(dev)
        t2 = time.perf_counter()
        eng.zero_grad()
        bus = eng.transfers.seconds()
        network = sum(r["seconds"] for r in eng.comm.summary().values())
        note(f"zl step, {path}", t2 - t1, rnd)
        note(f"zl step, {path}: the update inside", inside["seconds"], rnd)
        note(f"zl step, {path}: bus copies", bus, rnd)
        note(f"zl step, {path}: rest (casts, check, gather)", t2 - t1 - inside["seconds"] - bus - network, rnd)
        if gpu:
            note(f"zl iteration, {path}", t2 - t0, rnd)

    def ds_engine_row(rnd):
        t0 = time.perf_counter()
        _, loss = gpt_loss(ds_eng, tokens(cfg, rnd, batch, seq, dev))
        ds_eng.backward(loss)
        sync(dev)
        t1 = time.perf_counter()
        ds_eng.step()
        sync(dev)
        t2 = time.perf_counter()
        note("DeepSpeed ZeRO-2 offload step", t2 - t1, rnd)
        note("DeepSpeed ZeRO-2 offload iteration", t2 - t0, rnd)

    def each(fn, *lists):
        return lambda: [fn(*xs) for xs in zip(*lists)]

    def ds_and_cast():
        ds_adam.step()
        for b, p in zip(bf16, flat):
            b.copy_(p)

    rows = [lambda r: zl_row(False, r), lambda r: zl_row(True, r),
            lambda r: (set_group_path(torch_adamw, False), timed("AdamW foreach, alone", r, torch_adamw.step)),
            lambda r: (set_group_path(torch_adamw, True), timed("AdamW fused, alone", r, torch_adamw.step)),
            lambda r: timed("cast bf16 -> fp32 on the host", r, each(lambda b, p: p.grad.copy_(b), bf16, flat)),
            lambda r: timed("cast fp32 -> bf16 on the host", r, each(lambda b, p: b.copy_(p), bf16, flat))]
    if gpu:
        rows += [lambda r: timed("bf16 copy down + host cast", r,
                                 each(lambda d, b, p: p.grad.copy_(b.copy_(d)), on_gpu, bf16, flat)),
                 lambda r: timed("GPU cast + fp32 copy down", r, each(lambda d, p: p.grad.copy_(d.float()), on_gpu, flat))]
    if ds_adam is not None:
        rows += [lambda r: timed("DeepSpeedCPUAdam, alone", r, ds_adam.step),
                 lambda r: timed("DeepSpeedCPUAdam + its cast to bf16", r, ds_and_cast)]
    if ds_eng is not None:
        rows.append(ds_engine_row)
    for rnd in range(1 + opts["repeats"]):          # round 0 is the warm-up (the state is allocated)
        if rnd > 1 and time.monotonic() > deadline:
            print(f"deadline: stopped after {rnd - 1} rounds", flush=True)
            break
        for row in rows:
            try:
                row(rnd)
            except Exception as e:  # noqa: BLE001 - one row's failure is recorded, the rest go on
                out["errors"][f"round {rnd}"] = f"{type(e).__name__}: {e}"[:500]
                print("FAILED:", out["errors"][f"round {rnd}"], flush=True)
    out["host_bytes"] = eng.memory_report()["host"]
    return out


def summarise(rows: dict) -> dict:
    """Each row's median, min and max in ms over the rounds after the warm-up (round 0)."""
    table = {}
    for name, times in rows.items():
        xs = times[1:] or times
        table[name] = {"median_ms": statistics.median(xs) * 1e3, "min_ms": min(xs) * 1e3,
                       "max_ms": max(xs) * 1e3, "rounds": len(xs)}
    return table


def main(argv=None):
    started = time.monotonic()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("outdir", nargs="?", default="gpu/results/new")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="a 2-layer GPT: try the script")
    p.add_argument("--deepspeed", action="store_true", help="DeepSpeed's CPU-Adam (and on a GPU its engine)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--deadline", type=float, default=60.0,
                   help="no new round this many seconds after the start (after DeepSpeed's build)")
    p.add_argument("--batch", type=int, default=None, help="sequences a backward (GPU 8, CPU 1)")
    p.add_argument("--seq", type=int, default=None, help="tokens a sequence (GPU 1024, CPU 8)")
    opts = vars(p.parse_args(argv))
    gpu = opts["device"] == "cuda"
    opts["batch"] = opts["batch"] or (8 if gpu else 1)
    opts["seq"] = opts["seq"] or (1024 if gpu else 8)
    os.makedirs(opts["outdir"], exist_ok=True)
    os.environ["OMP_NUM_THREADS"] = str(opts["threads"])   # (the rank's OpenMP: DeepSpeed's loop)
    jsonl = os.path.join(opts["outdir"], "host_step.jsonl")
    if os.path.exists(jsonl):
        os.remove(jsonl)
    from zerolab.bench import DEEPSPEED_GRADIENT_CLIPPING
    out = {"machine": machine(), "options": dict(opts), "what": __doc__.split("\n\n")[2],
           "deepspeed_gradient_clipping": DEEPSPEED_GRADIENT_CLIPPING}
    if opts["deepspeed"]:
        print("building DeepSpeed's CPU-Adam op (about a minute the first time) ...", flush=True)
        opts["deepspeed_op"] = out["deepspeed_op"] = build_deepspeed_op()
        print(f"DeepSpeed's CPU-Adam op: {out['deepspeed_op']}", flush=True)
    # the rank's deadline, on the same clock (CLOCK_MONOTONIC is one clock for the whole machine)
    opts["deadline_at"] = time.monotonic() + opts["deadline"]
    try:
        out.update(zl.launch(host_step_worker, 1, backend="nccl" if gpu else "gloo", args=(opts, jsonl))[0])
    except Exception as e:  # noqa: BLE001 - whatever was measured is still written
        out["error"] = f"{type(e).__name__}: {str(e)[-1500:]}"
        print("launch failed:", out["error"], flush=True)
        if os.path.exists(jsonl):
            with open(jsonl) as f:
                for line in f:
                    r = json.loads(line)
                    out.setdefault("rows", {}).setdefault(r["row"], []).append(r["seconds"])
    out["table"] = summarise(out.get("rows", {}))
    out["wall_s"] = time.monotonic() - started
    print(f"\n{'row':<46} {'median ms':>10} {'min-max':>17}")
    for name, r in out["table"].items():
        print(f"{name:<46} {r['median_ms']:>10.1f} {r['min_ms']:>8.1f}-{r['max_ms']:<8.1f}")
    path = os.path.join(opts["outdir"], "host_step.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(f"wrote {path} ({out['wall_s']:.0f} s)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
