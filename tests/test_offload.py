"""zl.ZeRO(offload="optimizer") against independent references.

* parity: stages 1, 2, 3 with offload equal the SAME engine without offload, bit for bit
  (torch.equal), at N = 1, 2, 4, in fp32 with gradient accumulation and clipping, and in fp16
  with an overflow on one rank (every rank skips the same step);
* bytes: the device <-> host ledger (engine.transfers) per step against the closed form below,
  computed from the model's parameter counts, never from the engine;
* memory: memory_report()'s "host" bytes against (4 + 8 + 4 + c) bytes per element of the
  shard: master, Adam's moments, the persistent fp32 gradient, the staging buffer (c: 2 in bf16,
  none in fp32), plus 4 bytes of step count per tensor the optimizer updates;
* the persistent gradient buffer: a ZeRO-3 unit no backward reached at a later step adds zeros,
  not its last gradient, to the clipping norm;
* fused=True (the one-pass update, the script's choice): offload is bit for bit the engine
  without it, and within fp32 round-off of one process with torch's default AdamW;
* delay_update: against a single-process torch loop built by hand with the lag, at N = 1 (bit
  for bit) and N = 2 (on the global batch, within fp32 round-off); an fp16 give-up names the
  module that overflowed, as without it;
* offload="disk": the same parity, disk bytes from /proc against their closed form, a GPT 4x a
  memory budget, a kill in the middle of a write, a full or read-only offload_dir;
* checkpoints: save, load into a fresh engine, resume: bit for bit the uninterrupted run;
* bad input: clear errors before anything is built.

The closed form. Each rank owns Psi_pad / N elements: with one flat bucket (stages 1 and 2)
Psi_pad / N = ceil(Psi / N); stage 3 pads every unit (each GPT block, and the root: the rest)
on its own, so Psi_pad / N = sum over units of ceil(Psi_u / N). Per step:

    d2h = (Psi_pad / N) * bytes of the reduced gradient
          (the compute dtype, or fp32 where micro-batches accumulate in fp32: stages 2 and 3)
    h2d = (Psi_pad / N) * bytes of the compute dtype

One launch per world size runs every case (ranks are slow to start on a shared CPU).
"""

import math
import os
import re
import shutil
import tempfile
import time
from functools import lru_cache, partial

import pytest
import torch
import torch.distributed as dist

import zerolab as zl

from helpers import PARITY_ADAMW, backward_in_micro_batches, build
from zerolab.models import GPT, gpt_config

from tolerances import fp32_adamw_tol

pytestmark = pytest.mark.slow     # launches ranks or processes (make test-fast leaves it out)

OPT = PARITY_ADAMW
FUSED = partial(torch.optim.AdamW, lr=1e-3, eps=1e-6, weight_decay=0.1, fused=True)
STEPS = 3


def grouped(params):
    """Two parameter groups (decay / no decay): the optimizer holds views of the flat shards."""
    params = list(params)
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                             lr=1e-3, eps=1e-6)




def train(stage, precision, offload, *, kind="gpt", micro=1, clip=None, inf_step=None,
          bucket_mb=0.02, steps=STEPS, offload_dir=None, opt=OPT):
    rank, n = dist.get_rank(), dist.get_world_size()
    model, data, loss_fn, B = build(kind, 0 if rank == 0 else 100 + rank)
    kw = {"offload": "optimizer"} if offload else {}
    if offload == "disk":
        kw = {"offload": "disk", "offload_dir": offload_dir}
    eng = zl.ZeRO(model, opt, stage=stage, precision=precision, bucket_mb=bucket_mb,
                  max_grad_norm=clip, **kw)
    applied, moved, norms, disk = [], [], [], []
    for s in range(steps):
        io0 = eng.disk_io() if offload == "disk" else None
        x, y = data.batch(s, B * micro, rank, n)
        poison = float("inf") if s == inf_step and rank == n - 1 else 1.0   # one rank's loss overflows
        backward_in_micro_batches(
            eng, lambda m: loss_fn(eng, (x[m * B:(m + 1) * B], y[m * B:(m + 1) * B]))[1] / micro * poison, micro)
        if offload:
            eng.transfers.reset()
        applied.append(eng.step())
        norms.append(eng.last_grad_norm)
        if offload:
            moved.append((eng.transfers.bytes("d2h"), eng.transfers.bytes("h2d")))
        eng.zero_grad()
        if offload == "disk":           # disk bytes of this whole step (forward, backward, step)
            io = eng.disk_io()
            disk.append((io["read"] - io0["read"], io["written"] - io0["written"]))
    return {"state": eng.full_state_dict(), "applied": applied, "moved": moved, "norms": norms, "disk": disk,
            "memory": eng.memory_report(), "opt_tensors": len(eng.optimizer.state)}


def same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def resume_run(root, stage, mode, resume):
    """bf16, 4 steps; a checkpoint after step 2 (zl.checkpoint); resume=True: a fresh engine
    loads it and trains steps 3 and 4."""
    from zerolab import checkpoint
    rank, n = dist.get_rank(), dist.get_world_size()
    model, data, loss_fn, B = build("gpt", 0)
    kw = {"offload": mode}
    if mode == "disk":
        kw["offload_dir"] = os.path.join(root, f"resume{stage}{resume}")
    eng = zl.ZeRO(model, OPT, stage=stage, precision="bf16", **kw)
    path = os.path.join(root, f"ckpt{stage}{mode}")
    if resume:
        checkpoint.load(eng, path)
    for s in range(2 if resume else 0, 4):
        eng.backward(loss_fn(eng, data.batch(s, B, rank, n))[1])
        eng.step()
        eng.zero_grad()
        if s == 1 and not resume:
            checkpoint.save(eng, path)
    return eng.full_state_dict()


def worker(root, n):
    """Every case of world size n in one launch: parity at every n; bytes at n = 2 (the closed
    form covers any n, one is enough); the delayed update at n = 1 and 2 (its reference is one
    process on the global batch)."""
    out = {}
    if n in (1, 2):
        out["delayed"] = [delayed_run(stage) for stage in (1, 2, 3)]
    if n == 2:
        out["delayed"].append(delayed_run(3, land_after=1))    # finish_update() in mid-run
        out["delayed_gives_up"] = [delayed_give_up(stage) for stage in (1, 2, 3)]
        out["disk_gives_up"] = delayed_give_up(3, offload="disk", offload_dir=os.path.join(root, "give-up"))
        # a checkpoint (optimizer state included) and a resume
        for stage, mode in ((2, "optimizer"), (3, "disk")):
            out[("resume", stage, mode)] = same(resume_run(root, stage, mode, False),
                                                resume_run(root, stage, mode, True))
        out["skipped_unit"] = [skipping_run(offload) for offload in (False, True)]
        for stage in (2, 3):
            out[("fused", stage)] = fused_runs(stage)
    where = os.path.join(root, "case")
    for stage in (1, 2, 3):
        modes = ["optimizer"] + (["disk"] if stage == 3 else [])
        # fp32, two micro-batches, clipping at a norm the gradients exceed
        ref = train(stage, "fp32", False, micro=2, clip=0.05)
        for mode in modes:
            off = train(stage, "fp32", mode, micro=2, clip=0.05, offload_dir=where + "1")
            out[("fp32", stage, mode)] = (same(ref["state"], off["state"]), ref["norms"], off["norms"])
        # parameter groups: the optimizer steps on views of the shards (stage 1 remaps them as
        # stage 2 does; n = 2 only: one is enough)
        if n == 2 and stage > 1:
            ref = train(stage, "bf16", False, opt=grouped)
            for mode in modes:
                off = train(stage, "bf16", mode, opt=grouped, offload_dir=where + "4")
                out[("groups", stage, mode)] = same(ref["state"], off["state"])
        # fp16: the last rank's loss is inf at step 1: every rank skips it
        ref = train(stage, "fp16", False, kind="awkward", inf_step=1, bucket_mb=0.0002)
        for mode in modes:
            off = train(stage, "fp16", mode, kind="awkward", inf_step=1, bucket_mb=0.0002,
                        offload_dir=where + "2")
            out[("fp16", stage, mode)] = (same(ref["state"], off["state"]), ref["applied"], off["applied"])
        # bytes: bf16, one bucket; one micro-batch, then two
        for mode in (modes if n == 2 else []):
            for micro in (1, 2):
                r = train(stage, "bf16", mode, micro=micro, bucket_mb=25.0, steps=2,
                          offload_dir=where + f"3{micro}")
                out[("bytes", stage, mode, micro)] = (r["moved"], r["memory"], r["opt_tensors"], r["disk"])
        if n == 2:                      # fp32: no staging buffer
            r = train(stage, "fp32", "optimizer", bucket_mb=25.0, steps=2)
            out[("host fp32", stage)] = (r["memory"], r["opt_tensors"])
    return out


class SkipsABlock(torch.nn.Module):
    """Three blocks, each a ZeRO-3 unit (the children of the ModuleList); the middle one runs only
    when skip is False, so at a step with skip=True no backward reaches its unit."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.skip = False

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            if not (self.skip and i == 1):
                x = torch.tanh(block(x))
        return x


def skipping_run(offload):
    """ZeRO-3, fp32, clipping at a norm the gradients exceed; the middle unit is skipped at step
    1 only. Returns (full state, the clipping norms)."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = SkipsABlock()
    eng = zl.ZeRO(model, OPT, stage=3, max_grad_norm=0.01, **({"offload": "optimizer"} if offload else {}))
    norms = []
    for s in range(3):
        eng.module.skip = s == 1
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * s + rank))
        eng.backward(eng(x).pow(2).mean())
        eng.step()
        norms.append(float(eng.last_grad_norm))
        eng.zero_grad()
    return eng.full_state_dict(), norms


def fused_runs(stage):
    """AdamW(fused=True) at N ranks: offload, the same engine without offload, and one process on
    the global batch with torch's default AdamW (what a script gets without asking)."""
    n = dist.get_world_size()
    off = train(stage, "fp32", "optimizer", opt=FUSED)["state"]
    ref = train(stage, "fp32", False, opt=FUSED)["state"]
    model, data, loss_fn, B = build("gpt", 0)
    opt = OPT(model.parameters())
    for s in range(STEPS):
        loss_fn(model, data.global_batch(s, B * n))[1].backward()
        opt.step()
        opt.zero_grad()
    one = model.state_dict()
    return same(off, ref), max((off[k] - one[k]).abs().max().item() for k in one)


@lru_cache(maxsize=None)
def results(n):
    root = tempfile.mkdtemp(prefix="zl-offload-")
    try:
        return zl.launch(worker, n, args=(root, n))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def shard_numel(stage, n) -> int:
    """Psi_pad / N from the model's parameter counts (the closed form in the module doc)."""
    model = GPT(gpt_config("nano", bias=False))
    psi = sum(p.numel() for p in model.parameters())
    if stage in (1, 2):
        return math.ceil(psi / n)
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    return sum(math.ceil(b / n) for b in blocks) + math.ceil((psi - sum(blocks)) / n)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_offload_is_bit_for_bit_the_engine_without_it(n):
    for rank_out in results(n):
        for stage, mode in ((1, "optimizer"), (2, "optimizer"), (3, "optimizer"), (3, "disk")):
            equal, ref_norms, off_norms = rank_out[("fp32", stage, mode)]
            assert equal, f"fp32 stage {stage}, N={n}: offload={mode} changed the weights"
            assert ref_norms == off_norms and min(ref_norms) > 0.05, "clipping did not act"
            equal, ref_applied, off_applied = rank_out[("fp16", stage, mode)]
            assert equal, f"fp16 stage {stage}, N={n}: offload={mode} changed the weights"
            assert ref_applied == off_applied == [True, False, True]
            if n == 2 and stage > 1:
                assert rank_out[("groups", stage, mode)], f"stage {stage}: offload={mode} with parameter groups"


@pytest.mark.parametrize("n", [2])
def test_bytes_down_and_up_per_step_are_the_closed_form(n):
    for rank_out in results(n):
        for stage in (1, 2, 3):
            k = shard_numel(stage, n)
            for micro in (1, 2):
                moved, memory, opt_tensors, _ = rank_out[("bytes", stage, "optimizer", micro)]
                # gradients: bf16 (2 bytes) as reduced; fp32 (4) once stages 2-3 accumulate
                grad_bytes = 4 if (micro == 2 and stage in (2, 3)) else 2
                assert moved == [(grad_bytes * k, 2 * k)] * 2, (stage, micro, moved, k)
                # host, per element: fp32 master (4) + Adam's two moments (8) + the fp32 gradient
                # buffer (4) + the bf16 staging buffer (2); one 4-byte step counter per tensor the
                # optimizer updates; the device keeps the rest
                assert memory["host"] == (4 + 8 + 4 + 2) * k + 4 * opt_tensors, (stage, memory, k)
                assert memory["device"] == memory["total"] - memory["host"] > 0
            memory, opt_tensors = rank_out[("host fp32", stage)]
            assert memory["host"] == (4 + 8 + 4) * k + 4 * opt_tensors, (stage, memory, k)   # no staging


def test_a_zero3_unit_no_backward_reached_adds_zeros_to_the_norm_not_its_last_gradient():
    # the host's fp32 gradient buffer outlives the step: a unit skipped at step 1 must count as
    # zeros (as without offload), or the clipping norm and every weight after it change
    for rank_out in results(2):
        (ref, ref_norms), (off, off_norms) = rank_out["skipped_unit"]
        assert min(ref_norms) > 0.01, "clipping did not act"
        assert off_norms == ref_norms, (off_norms, ref_norms)
        assert same(ref, off), "offload changed the weights of a run with a skipped unit"


def test_fused_adamw_on_the_host_is_the_engine_without_offload_and_near_one_process():
    # AdamW(fused=True) is the script's choice (zerolab never switches it on): with it, offload is
    # still bit for bit the engine without offload (the same kernel on the same values), and one
    # process with torch's default AdamW differs by the two summation orders and the fused
    # kernel's last-bit rounding: within fp32_adamw_tol (tests/tolerances.py)
    for rank_out in results(2):
        for stage in (2, 3):
            equal, diff = rank_out[("fused", stage)]
            assert equal, f"stage {stage}: offload with fused AdamW changed the weights"
            assert diff <= fp32_adamw_tol(STEPS), f"stage {stage}: {diff:.2e} from one process"


def test_a_checkpoint_of_an_offloaded_engine_resumes_bit_for_bit():
    for rank_out in results(2):
        for stage, mode in ((2, "optimizer"), (3, "disk")):
            assert rank_out[("resume", stage, mode)], f"stage {stage}, offload={mode}: resume differs"


def delayed_run(stage, steps=4, land_after=None):
    """delay_update at N ranks against ONE process with the lag written out: the gradient of
    step t is computed on the weights published after step t-2, and applied to those after t-1.
    The reference sees step t's global batch (the N ranks' batches, concatenated): the
    data-parallel gradient is the average of the ranks' gradients, which is the gradient of the
    mean loss over the global batch. Returns (bit for bit?, largest difference from the lagged
    reference, largest difference from the same run without the lag).
    (At N=1 the engine without offload equals plain torch bit for bit: same arithmetic. At N=2
    the mean over the global batch is summed in another order than (rank 0's mean + rank 1's
    mean) / 2: equal up to fp32 round-off.) land_after=s: finish_update() after step s, so step
    s+1's forward already sees update s (as after a checkpoint); the reference does the same."""
    rank, n = dist.get_rank(), dist.get_world_size()
    model, data, loss_fn, B = build("gpt", 0)
    eng = zl.ZeRO(model, OPT, stage=stage, offload="optimizer", delay_update=True)
    ref, _, _, _ = build("gpt", 0)
    opt = OPT(list(ref.parameters()))
    published = [p.detach().clone() for p in ref.parameters()]   # what forward sees
    plain, _, _, _ = build("gpt", 0)                               # no lag at all
    plain_opt = OPT(list(plain.parameters()))
    for s in range(steps):
        eng.backward(loss_fn(eng, data.batch(s, B, rank, n))[1])
        eng.step()
        eng.zero_grad()
        batch = data.global_batch(s, B * n)
        # by hand: forward on the published weights, update the latest ones
        latest = [p.detach().clone() for p in ref.parameters()]
        with torch.no_grad():
            for p, w in zip(ref.parameters(), published):
                p.copy_(w)
        loss_fn(ref, batch)[1].backward()
        with torch.no_grad():
            for p, w in zip(ref.parameters(), latest):
                p.copy_(w)
        opt.step()
        opt.zero_grad()
        published = latest           # the update just made is seen one step later
        if s == land_after:
            eng.finish_update()
            published = [p.detach().clone() for p in ref.parameters()]
        loss_fn(plain, batch)[1].backward()
        plain_opt.step()
        plain_opt.zero_grad()
    got = eng.full_state_dict()      # (lands the update in flight)
    want, undelayed = ref.state_dict(), plain.state_dict()
    return (all(torch.equal(got[k], want[k]) for k in want),
            max((got[k] - want[k]).abs().max().item() for k in want),
            max((got[k] - undelayed[k]).abs().max().item() for k in want))


def test_delayed_update_lags_one_step():
    for stage, (lag_equal, _, gap) in zip((1, 2, 3), results(1)[0]["delayed"]):
        assert lag_equal, f"stage {stage}: delay_update is not the hand-built one-step-lagged update"
        assert gap > 1e-4, f"stage {stage}: the delayed run should differ from the undelayed one by ~lr"


def test_delayed_update_lags_one_step_on_two_ranks():
    # not bit for bit: one process sums the global batch's loss in another order than the two
    # ranks (2.0e-7 apart after 4 steps, measured); fp32_adamw_tol(4) = 2.4e-5 is the suite's
    # bound for two summation orders (tests/tolerances.py), and the lag itself moves ~5e-3
    for rank_out in results(2):
        runs = zip(("stage 1", "stage 2", "stage 3", "stage 3, landed mid-run"), rank_out["delayed"])
        for what, (_, diff, gap) in runs:
            assert diff <= fp32_adamw_tol(4), f"{what}, N=2: {diff:.2e} from the hand-built lagged update"
            assert gap > 1e-4, f"{what}, N=2: the delayed run should differ from the undelayed one by ~lr"


class Boost(torch.nn.Module):
    """x * gain: with gain 1e6 its fp16 output is inf (fp16's largest value is 65504)."""
    gain = 1.0

    def forward(self, x):
        return x * self.gain


def delayed_give_up(stage, **offload):
    """fp16 with delay_update (or `offload`): step 0 is finite (its update is in flight during
    step 1), then Boost overflows at every step: the scale backs off 8 -> 4 -> 2 -> 1 and step
    4 gives up."""
    offload = offload or {"offload": "optimizer", "delay_update": True}
    from collections import OrderedDict
    from zerolab.precision import LossScaler
    torch.manual_seed(0)
    boost = Boost()
    model = torch.nn.Sequential(OrderedDict(proj=torch.nn.Linear(4, 4), boost=boost, head=torch.nn.Linear(4, 1)))
    eng = zl.ZeRO(model, partial(torch.optim.SGD, lr=0.1), stage=stage, precision="fp16",
                  scaler=LossScaler(init_scale=8.0), **offload)
    applied = []
    try:
        for s in range(10):
            boost.gain = 1.0 if s == 0 else 1e6
            eng.backward(eng(torch.randn(2, 4)).float().sum())
            applied.append(eng.step())
            eng.zero_grad()
    except FloatingPointError as e:
        return applied, str(e)
    return applied, "never gave up"


def test_an_fp16_give_up_under_delay_update_or_from_disk_names_the_module():
    # as tests/test_precision.py for the engines without offload: Boost is the only module
    # whose output can exceed fp16's range (an independent reference for "which module")
    for rank_out in results(2):
        cases = list(zip((1, 2, 3), rank_out["delayed_gives_up"])) + [("3, disk", rank_out["disk_gives_up"])]
        for stage, (applied, message) in cases:
            assert applied == [True, False, False, False], (stage, applied)
            assert "fp16 gives up at step 4" in message, (stage, message)
            assert "boost produced inf" in message and "its inputs were finite" in message, (stage, message)


BAD = [
    (dict(stage=1, offload="gpu"), ValueError, "offload must be None, 'optimizer'"),
    (dict(stage=2, offload="disk", offload_dir="/tmp"), ValueError, "offload='disk' needs stage=3"),
    (dict(stage=3, offload="disk"), ValueError, "needs offload_dir"),
    (dict(stage=2, offload="optimizer", offload_dir="/tmp"), ValueError, "offload_dir is for offload='disk'"),
    (dict(stage=2, offload_dir="/tmp"), ValueError, "options of offload"),
    (dict(stage=1, delay_update=True), ValueError, "options of offload"),
    (dict(stage=1, offload="optimizer", delay_update=1), TypeError, "delay_update must be True or False"),
    (dict(stage=3, offload="disk", offload_dir="/tmp", delay_update=True), ValueError, "needs offload='optimizer'"),
]


@pytest.mark.parametrize("kw,error,words", BAD, ids=[str(b[0]) for b in BAD])
def test_bad_offload_options_are_refused_before_anything_is_built(kw, error, words, monkeypatch):
    # no process group exists: an engine that got as far as communicating would fail differently
    monkeypatch.setattr(dist, "is_initialized", lambda: pytest.fail("reached torch.distributed"))
    with pytest.raises(error, match=re.escape(words)):
        zl.ZeRO(torch.nn.Linear(2, 2), OPT, **kw)


@pytest.mark.parametrize("n", [2])
def test_disk_bytes_per_step_from_the_os_are_the_closed_form(n):
    """offload="disk", bf16 (c = 2 bytes), k = Psi_pad / N, m micro-batches whose gradient shard
    is bf16 after the first (g_1 = 2) and fp32 once accumulated (g_j = 4, j >= 2). Per step:
      read    = (2 c m  +  g_1 + ... + g_{m-1}  +  2 g_m  +  12) k
                (parameters in every forward and backward, the shard read back to accumulate,
                 the gradient in both passes of the step, master 4 and Adam's moments 8)
      written = (g_1 + ... + g_m  +  12  +  c) k
    The first step has no optimizer state to read: 8 k less. d2h = g_m k, h2d = c k."""
    c = 2
    for rank_out in results(n):
        k = shard_numel(3, n)
        for micro in (1, 2):
            moved, memory, _, disk = rank_out[("bytes", 3, "disk", micro)]
            g = [2] + [4] * (micro - 1)
            read = (2 * c * micro + sum(g[:-1]) + 2 * g[-1] + 12) * k
            written = (sum(g) + 12 + c) * k
            assert disk == [(read - 8 * k, written), (read, written)], (micro, disk, k)
            assert moved == [(g[-1] * k, c * k)] * 2
            assert memory["host"] < 1024       # between steps, the files hold everything


def test_a_model_four_times_the_memory_budget_trains_from_disk(tmp_path):
    """The headline: the book's GPT whose model states (16 bytes per parameter: fp32 parameter,
    gradient, two Adam moments) are 4x the budget trains with offload="disk" with a resident-set
    growth (VmHWM - VmRSS before the engine, from /proc/self/status) under the budget, and
    loses exactly what the same run in memory loses, which grows by more than the states."""
    from zerolab.book.offload_demo import budget_worker
    r = zl.launch(budget_worker, 1, args=(str(tmp_path),))[0]
    disk, memory = r["disk"], r["memory"]
    budget = disk["states"] / 4
    assert disk["growth"] <= budget, (disk["growth"] / 2**20, budget / 2**20)
    assert memory["growth"] >= disk["states"], "the measurement should see the in-memory states"
    assert disk["losses"] == memory["losses"]
    read = [io[0] for io in disk["disk_io"]]
    assert read[1:] == [28 * disk["k"]] * (len(read) - 1)    # fp32: (2c + 2g + 12) k, c = g = 4


def dying_worker(root):
    """Disk offload, checkpoint after step 1; in step 2 the process is SIGKILLed while it writes
    unit 1's new master: its bytes are out, the file is not yet in place (the last instant of
    a write; with a write in place instead of write + rename, nothing would kill it)."""
    import signal
    from zerolab import checkpoint
    model, data, loss_fn, B = build("gpt", 0)
    eng = zl.ZeRO(model, OPT, stage=3, offload="disk", offload_dir=os.path.join(root, "offload"))
    for s in range(2):
        if s == 1:
            replace = os.replace

            def dying_replace(src, dst):
                if str(src).endswith("unit1.master.bin.tmp"):
                    os.kill(os.getpid(), signal.SIGKILL)
                replace(src, dst)
            os.replace = dying_replace
        eng.backward(loss_fn(eng, data.batch(s, B, 0, 1))[1])
        eng.step()
        eng.zero_grad()
        checkpoint.save(eng, os.path.join(root, "ckpt"))


def loading_worker(root):
    from zerolab import checkpoint
    model, _, _, _ = build("gpt", 1)
    eng = zl.ZeRO(model, OPT, stage=3)
    checkpoint.load(eng, os.path.join(root, "ckpt"))
    return eng.full_state_dict()


def test_a_rank_killed_mid_write_leaves_checkpoint_and_offload_files_whole(tmp_path):
    from zerolab.launch.results import LaunchError
    with pytest.raises(LaunchError, match="SIGKILL"):
        zl.launch(dying_worker, 1, args=(str(tmp_path),))
    saved = zl.launch(loading_worker, 1, args=(str(tmp_path),))[0]     # the step-1 checkpoint loads
    # unit 1 is blocks.0: its master file still holds the step-1 values, whole
    model, _, _, _ = build("gpt", 0)
    names = [f"blocks.0.{name}" for name, _ in model.blocks[0].named_parameters()]
    want = torch.cat([saved[k].reshape(-1) for k in names])
    path = tmp_path / "offload" / "rank0" / "unit1.master.bin"
    got = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.float32)
    assert torch.equal(got, want)
    new = torch.frombuffer(bytearray((path.parent / "unit1.master.bin.tmp").read_bytes()), dtype=torch.float32)
    assert new.shape == got.shape and not torch.equal(new, got)     # step 2's, never put in place


def test_a_full_or_read_only_offload_dir_is_refused_at_construction(tmp_path, monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: pytest.fail("reached torch.distributed"))
    model = torch.nn.Linear(64, 64)
    with pytest.raises(PermissionError, match="not a writable directory"):   # a read-only filesystem
        zl.ZeRO(model, OPT, stage=3, offload="disk", offload_dir="/proc/zerolab-offload")
    (tmp_path / "file").write_text("x")
    with pytest.raises(PermissionError, match="not a writable directory"):   # not a directory
        zl.ZeRO(model, OPT, stage=3, offload="disk", offload_dir=str(tmp_path / "file" / "sub"))
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(OSError, match="MiB free"):                               # a full disk
        zl.ZeRO(model, OPT, stage=3, offload="disk", offload_dir=str(tmp_path / "full"))


# ------------------------------------------------------------------ delay_update and a scheduler


class SlowAdamW(torch.optim.AdamW):
    """AdamW that reads its learning rate only after a pause: the delayed update's thread then
    surely runs after the main thread's scheduler.step() (a race that is otherwise 1 in 6). (The
    optimizer's own step() called by the script finds no gradient under delay_update, the thread
    runs the update: only a step that updates something counts.)"""

    used: list = []

    def step(self, closure=None):
        if any(p.grad is not None for g in self.param_groups for p in g["params"]):
            time.sleep(0.3)
            SlowAdamW.used.append(self.param_groups[0]["lr"])
        return super().step(closure)


def delayed_with_a_scheduler():
    model, data, loss_fn, B = build("gpt", 0)
    eng = zl.ZeRO(model, SlowAdamW(model.parameters(), lr=1e-3), stage=2, offload="optimizer",
                  delay_update=True)
    scheduler = torch.optim.lr_scheduler.StepLR(eng.optimizer, step_size=1, gamma=0.5)
    for s in range(3):
        loss_fn(eng, data.batch(s, B, 0, 1))[1].backward()
        eng.optimizer.step()
        eng.optimizer.zero_grad()
        scheduler.step()            # while the update of step s runs on its thread
    eng.finish_update()
    return SlowAdamW.used


def test_a_scheduler_under_delay_update_changes_the_next_step_not_the_one_in_flight():
    # each update uses the learning rate of the step() that started it: 1e-3, then halved per step
    assert zl.launch(delayed_with_a_scheduler, 1)[0] == [1e-3, 5e-4, 2.5e-4]


def on_a_box_with_a_gpu(root):
    """Offload of CPU tensors where torch reports a GPU: pinning memory would create a CUDA
    context (hundreds of MB, and here an error: this machine has none). Nothing may be pinned."""
    torch.cuda.is_available = lambda: True
    pinned = []
    real_empty = torch.empty

    def empty(*args, **kwargs):
        pinned.append(bool(kwargs.get("pin_memory")))
        return real_empty(*args, **{**kwargs, "pin_memory": False})
    torch.empty = empty
    try:
        for stage, mode in ((2, "optimizer"), (3, "disk")):
            train(stage, "bf16", mode, offload_dir=os.path.join(root, str(stage)), steps=2)
    finally:
        torch.empty = real_empty
    return len(pinned), sum(pinned)


def test_cpu_tensors_are_never_pinned_even_where_a_gpu_exists(tmp_path):
    made, pinned = zl.launch(on_a_box_with_a_gpu, 1, args=(str(tmp_path),))[0]
    assert made > 0 and pinned == 0, f"{pinned} of {made} host buffers were pinned for CPU tensors"
