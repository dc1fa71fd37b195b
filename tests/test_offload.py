"""zl.ZeRO(offload="optimizer") against independent references.

* parity: stages 1, 2, 3 with offload equal the SAME engine without offload, bit for bit
  (torch.equal), at N = 1, 2, 4, in fp32 with gradient accumulation and clipping, and in fp16
  with an overflow on one rank (every rank skips the same step);
* bytes: the device <-> host ledger (engine.transfers) per step against the closed form below,
  computed from the model's parameter counts, never from the engine;
* memory: memory_report()'s "host" bytes against 12 bytes per element of the shard;
* delay_update: against a single-process torch loop built by hand with the lag;
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
import re
from functools import lru_cache, partial

import pytest
import torch
import torch.distributed as dist

import zerolab as zl
from zerolab.data import CharDataset, SyntheticRegression
from zerolab.models import GPT, AwkwardModel, gpt_config, gpt_loss, regression_loss

OPT = partial(torch.optim.AdamW, lr=1e-3, eps=1e-6, weight_decay=0.1)
STEPS = 3


def build(kind, seed):
    torch.manual_seed(seed)
    if kind == "gpt":
        return GPT(gpt_config("nano", bias=False)), CharDataset(32), gpt_loss, 2
    return AwkwardModel(), SyntheticRegression(d_in=13, d_out=5), regression_loss, 3


def train(stage, precision, offload, *, kind="gpt", micro=1, clip=None, inf_step=None,
          bucket_mb=0.02, steps=STEPS):
    rank, n = dist.get_rank(), dist.get_world_size()
    model, data, loss_fn, B = build(kind, 0 if rank == 0 else 100 + rank)
    kw = {"offload": "optimizer"} if offload else {}
    eng = zl.ZeRO(model, OPT, stage=stage, precision=precision, bucket_mb=bucket_mb,
                  max_grad_norm=clip, **kw)
    applied, moved, norms = [], [], []
    for s in range(steps):
        x, y = data.batch(s, B * micro, rank, n)
        for m in range(micro):
            loss = loss_fn(eng, (x[m * B:(m + 1) * B], y[m * B:(m + 1) * B]))[1] / micro
            if s == inf_step and rank == n - 1:
                loss = loss * float("inf")
            if m < micro - 1:
                with eng.no_sync():
                    eng.backward(loss)
            else:
                eng.backward(loss)
        if offload:
            eng.transfers.reset()
        applied.append(eng.step())
        norms.append(eng.last_grad_norm)
        if offload:
            moved.append((eng.transfers.bytes("d2h"), eng.transfers.bytes("h2d")))
        eng.zero_grad()
    return {"state": eng.full_state_dict(), "applied": applied, "moved": moved, "norms": norms,
            "memory": eng.memory_report(), "opt_tensors": len(eng.optimizer.state)}


def same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def worker():
    out = {}
    for stage in (1, 2, 3):
        # fp32, two micro-batches, clipping at a norm the gradients exceed
        ref = train(stage, "fp32", False, micro=2, clip=0.05)
        off = train(stage, "fp32", True, micro=2, clip=0.05)
        out[("fp32", stage)] = (same(ref["state"], off["state"]), ref["norms"], off["norms"])
        # fp16: the last rank's loss is inf at step 1: every rank skips it
        ref = train(stage, "fp16", False, kind="awkward", inf_step=1, bucket_mb=0.0002)
        off = train(stage, "fp16", True, kind="awkward", inf_step=1, bucket_mb=0.0002)
        out[("fp16", stage)] = (same(ref["state"], off["state"]), ref["applied"], off["applied"])
        # bytes: bf16, one bucket; one micro-batch, then two
        for micro in (1, 2):
            r = train(stage, "bf16", True, micro=micro, bucket_mb=25.0, steps=2)
            out[("bytes", stage, micro)] = (r["moved"], r["memory"], r["opt_tensors"])
    return out


@lru_cache(maxsize=None)
def results(n):
    return zl.launch(worker, n)


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
        for stage in (1, 2, 3):
            equal, ref_norms, off_norms = rank_out[("fp32", stage)]
            assert equal, f"fp32 stage {stage}, N={n}: offload changed the weights"
            assert ref_norms == off_norms and min(ref_norms) > 0.05, "clipping did not act"
            equal, ref_applied, off_applied = rank_out[("fp16", stage)]
            assert equal, f"fp16 stage {stage}, N={n}: offload changed the weights"
            assert ref_applied == off_applied == [True, False, True]


@pytest.mark.parametrize("n", [1, 2, 4])
def test_bytes_down_and_up_per_step_are_the_closed_form(n):
    for rank_out in results(n):
        for stage in (1, 2, 3):
            k = shard_numel(stage, n)
            for micro in (1, 2):
                moved, memory, opt_tensors = rank_out[("bytes", stage, micro)]
                # gradients: bf16 (2 bytes) as reduced; fp32 (4) once stages 2-3 accumulate
                grad_bytes = 4 if (micro == 2 and stage in (2, 3)) else 2
                assert moved == [(grad_bytes * k, 2 * k)] * 2, (stage, micro, moved, k)
                # host: fp32 master (4) + Adam's two moments (8) per element, one 4-byte step
                # counter per tensor the optimizer updates; the device keeps the rest
                assert memory["host"] == 12 * k + 4 * opt_tensors, (stage, memory, k)
                assert memory["device"] == memory["total"] - memory["host"] > 0


def delayed_worker():
    return [delayed_run(stage) for stage in (1, 2, 3)]


def delayed_run(stage, steps=4):
    """delay_update at N=1 against plain torch with the lag written out: the gradient of step t
    is computed on the weights published after step t-2, and applied to those after t-1.
    (At N=1 the engine without offload equals plain torch bit for bit: same arithmetic.)"""
    model, data, loss_fn, B = build("gpt", 0)
    eng = zl.ZeRO(model, OPT, stage=stage, offload="optimizer", delay_update=True)
    ref, _, _, _ = build("gpt", 0)
    opt = OPT(list(ref.parameters()))
    published = [p.detach().clone() for p in ref.parameters()]   # what forward sees
    plain, _, _, _ = build("gpt", 0)                               # no lag at all
    plain_opt = OPT(list(plain.parameters()))
    for s in range(steps):
        batch = data.batch(s, B, 0, 1)
        eng.backward(loss_fn(eng, batch)[1])
        eng.step()
        eng.zero_grad()
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
        loss_fn(plain, batch)[1].backward()
        plain_opt.step()
        plain_opt.zero_grad()
    got = eng.full_state_dict()      # (lands the update in flight)
    want, undelayed = ref.state_dict(), plain.state_dict()
    return (all(torch.equal(got[k], want[k]) for k in want),
            max((got[k] - undelayed[k]).abs().max().item() for k in want))


def test_delayed_update_lags_one_step():
    for stage, (lag_equal, gap) in zip((1, 2, 3), zl.launch(delayed_worker, 1)[0]):
        assert lag_equal, f"stage {stage}: delay_update is not the hand-built one-step-lagged update"
        assert gap > 1e-4, f"stage {stage}: the delayed run should differ from the undelayed one by ~lr"


BAD = [
    (dict(stage=1, offload="gpu"), ValueError, "offload must be None, 'optimizer'"),
    (dict(stage=2, offload="disk", offload_dir="/tmp"), ValueError, "offload='disk' needs stage=3"),
    (dict(stage=3, offload="disk"), ValueError, "needs offload_dir"),
    (dict(stage=2, offload="optimizer", offload_dir="/tmp"), ValueError, "offload_dir is for offload='disk'"),
    (dict(stage=2, offload_dir="/tmp"), ValueError, "options of offload"),
    (dict(stage=1, delay_update=True), ValueError, "options of offload"),
    (dict(stage=1, offload="optimizer", delay_update=1), TypeError, "delay_update must be True or False"),
]


@pytest.mark.parametrize("kw,error,words", BAD, ids=[str(b[0]) for b in BAD])
def test_bad_offload_options_are_refused_before_anything_is_built(kw, error, words, monkeypatch):
    # no process group exists: an engine that got as far as communicating would fail differently
    monkeypatch.setattr(dist, "is_initialized", lambda: pytest.fail("reached torch.distributed"))
    with pytest.raises(error, match=re.escape(words)):
        zl.ZeRO(torch.nn.Linear(2, 2), OPT, **kw)
