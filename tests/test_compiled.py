"""ZeRO as passes over a captured step (zerolab.compiled), graded against the eager engines.

Weights: at world 2 the graph's weights equal zl.ZeRO(stage)'s bit for bit: a sum of two
ranks' parts is the same in either order, dividing by 2 is exact, and AdamW is elementwise.
At world 4 gloo adds the four parts in an order that depends on where an element sits in the
buffer it reduces; eager reduces one flat bucket, the graph one buffer per gradient (or its
own buckets), so the orders differ and the weights agree within fp32_adamw_tol (tolerances.py).

Memory: the liveness pass's prediction equals the allocation tracker's measured peak, to the
byte, on every rank, and so does the bytes alive after every allocation. Bytes: the ledger's against closed forms computed here from the model.
"""

import pytest
import torch

import zerolab as zl
from tolerances import fp32_adamw_tol
from zerolab.compiled import collectives, runs
from zerolab.compiled.capture import capture, gpt_loss
from zerolab.compiled.liveness import liveness
from zerolab.compiled.nodes import positions, views_of
from zerolab.compiled.shard import shard

STEPS = 3
PARITY = [(1, 0, 0), (2, 0, 0), (3, 0, 0), (2, 16384, 0), (3, 16384, 2)]


def psi(model) -> int:
    return sum(p.numel() for p in model.parameters())


def psi_read_by_backward(model) -> int:
    """The weights the backward reads: every Linear's weight and every LayerNorm's weight and
    bias. (A bias's gradient and an embedding's do not need their values.)"""
    n = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            n += m.weight.numel()
        elif isinstance(m, torch.nn.LayerNorm):
            n += m.weight.numel() + m.bias.numel()
    return n


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_weights_equal_eager_zero(world):
    results = zl.launch(runs.compare, world_size=world, args=(PARITY, STEPS))[0]
    for config, r in zip(PARITY, results):
        if world == 2:
            assert r["difference"] == 0.0, (config, r["difference"])
        else:
            assert r["difference"] <= fp32_adamw_tol(STEPS), (config, r["difference"])


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_the_bench_gpt_trains_as_eager_zero_on_every_stage(world):
    """The benchmark's GPT ("tiny", at this module's sequence length), stages 1, 2, 3."""
    results = zl.launch(runs.compare, world_size=world, args=([(1, 0, 0), (2, 0, 0), (3, 0, 0)], STEPS, "tiny"))[0]
    for stage, r in zip((1, 2, 3), results):
        if world == 2:
            assert r["difference"] == 0.0, (stage, r["difference"])
        else:
            assert r["difference"] <= fp32_adamw_tol(STEPS), (stage, r["difference"])


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_ledger_bytes_closed_form(world):
    configs = [(1, 0, 0), (2, 0, 0), (3, 0, 0), (3, 16384, 2)]
    results = zl.launch(runs.compare, world_size=world, args=(configs, 1))[0]
    model = runs.tiny_gpt()
    ring = (world - 1) / world * 4                      # fp32 bytes each rank sends per element
    full, backward = psi(model), psi_read_by_backward(model)
    for (stage, _, _), r in zip(configs, results):
        assert r["bytes"]["reduce_scatter"] == round(ring * full)
        gathered = full if stage < 3 else 2 * full - (full - backward)
        assert r["bytes"]["all_gather"] == round(ring * gathered)
        total = r["bytes"]["reduce_scatter"] + r["bytes"]["all_gather"]
        assert total == round(ring * (2 * full if stage < 3 else 2 * full + backward))
    assert results[2]["eager_bytes"]["all_gather"] == round(ring * 2 * full)   # eager ZeRO-3: 3 Psi in all


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_liveness_predicts_measured_peak(world):
    configs = [(1, 0, 0), (2, 0, 0), (2, 16384, 0), (3, 0, 0), (3, 0, 1), (3, 0, 3), (3, 16384, 2)]
    results = zl.launch(runs.peaks, world_size=world, args=(configs,))
    for rank, per_rank in enumerate(results):
        for config, r in zip(configs, per_rank):
            assert r["predicted"] == r["measured"], (rank, config, r["predicted"], r["measured"])
            assert r["predicted_timeline"] == r["measured_timeline"], (rank, config)   # allocation by allocation
    peaks = {c: r["predicted"] for c, r in zip(configs, results[0])}
    assert peaks[1, 0, 0] > peaks[2, 0, 0]              # ZeRO-1 keeps every full gradient to the end
    assert peaks[3, 0, 3] > peaks[3, 0, 1] >= peaks[3, 0, 0]   # prefetch holds weights sooner


def sharded_step(world=2):
    step = capture(runs.tiny_gpt(), gpt_loss, runs.batch(0, 0, world))
    return shard(step, world)


def test_each_gathered_weight_is_freed_after_its_last_reader_in_its_region():
    step = sharded_step()
    pos = positions(step.graph)
    loss_at = pos[step.loss_node()]
    for param in step.params():
        starts = [u for u in param.users if u.target is collectives.all_gather_start]
        assert 1 <= len(starts) <= 2
        for start in starts:
            weight = next(iter(next(iter(start.users)).users))
            frees = [u for u in weight.users if u.target is collectives.free]
            assert len(frees) == 1
            readers = [u for v in views_of(weight) for u in v.users if u is not frees[0]]
            assert max(pos[r] for r in readers) < pos[frees[0]]
            region = {pos[r] > loss_at for r in readers}
            assert len(region) == 1, f"{param.name}: one gathered copy read by forward and backward"


def test_liveness_of_an_unsharded_step_counts_activations_only():
    step = capture(runs.tiny_gpt(), gpt_loss, runs.batch(0, 0, 1))
    params = [p.detach().clone() for p in runs.tiny_gpt().parameters()]
    batch = runs.batch(0, 0, 1)
    with zl.memory.AllocationTracker() as tracker:
        out = step.module(*params, *batch)
    del out
    assert liveness(step).peak == tracker.peak
