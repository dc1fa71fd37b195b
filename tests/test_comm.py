"""The ledger: collectives give torch.distributed's results, and bytes follow the ring formulas."""

import pytest
import torch
import torch.distributed as dist

import zerolab as zl
from zerolab.runtime.comm import Ledger


def ledger_worker(numel):
    """Run each collective through the ledger and, independently, through torch.distributed."""
    r, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(100 + r)
    x = torch.randn(numel * n, generator=g)
    led = Ledger()
    out = {}

    a = x.clone(); led.all_reduce(a)
    b = x.clone(); dist.all_reduce(b)
    out["all_reduce"] = torch.equal(a, b)

    shard = torch.empty(numel); led.reduce_scatter(shard, x.clone())
    ref = [torch.empty(numel) for _ in range(n)]
    full = x.clone(); dist.all_reduce(full)
    # gloo's reduce-scatter and all-reduce may add the ranks' values in different orders: a few ulp
    out["reduce_scatter"] = torch.allclose(shard, full[r * numel:(r + 1) * numel], atol=1e-6)

    gathered = torch.empty(numel * n); led.all_gather(gathered, x[:numel].clone())
    dist.all_gather(ref, x[:numel].clone())
    out["all_gather"] = torch.equal(gathered, torch.cat(ref))

    c = x.clone(); led.broadcast(c, src=n - 1)
    d = x.clone(); dist.broadcast(d, src=n - 1)
    out["broadcast"] = torch.equal(c, d)

    h = led.all_reduce(x.clone(), async_op=True); h.wait()
    out["async_timed"] = led.records[-1].end is not None and led.records[-1].end >= led.records[-1].start
    out["bytes"] = {rec.op: rec.bytes_sent for rec in led.records[:4]}
    out["total"] = led.bytes()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_ledger_collectives_and_ring_bytes(world_size):
    numel = 1001  # odd on purpose
    results = zl.launch(ledger_worker, world_size, args=(numel,))
    n, S = world_size, 4 * numel * world_size  # S: bytes of the full fp32 tensor
    for r, out in enumerate(results):
        for op in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "async_timed"):
            assert out[op], f"{op} differs from torch.distributed on rank {r}"
        assert out["bytes"]["all_reduce"] == round(2 * (n - 1) / n * S)
        assert out["bytes"]["reduce_scatter"] == round((n - 1) / n * S)
        assert out["bytes"]["all_gather"] == round((n - 1) / n * S)
        # broadcast from rank n-1: the chain is n-1, 0, 1, ..., n-2; its last rank sends nothing
        assert out["bytes"]["broadcast"] == (0 if r == (n - 2) % n or n == 1 else S)
    # all ranks together send (N-1) copies of the tensor in a broadcast: everyone but the source receives one
    assert sum(o["bytes"]["broadcast"] for o in results) == (n - 1) * S


def test_ledger_bookkeeping_without_a_process_group():
    led = Ledger()
    t = torch.ones(8)
    led.all_reduce(t)  # one rank: nothing moves, the result is already in place
    assert torch.equal(t, torch.ones(8)) and led.bytes() == 0 and len(led.records) == 1
    out = torch.empty(8)
    led.all_gather(out, torch.arange(8.0))
    assert torch.equal(out, torch.arange(8.0))
    assert led.summary()["all_gather"]["calls"] == 1
    led.reset()
    assert len(led.records) == 0 and led.bytes() == 0


def test_ledger_rejects_bad_shapes_and_ops():
    led = Ledger()
    with pytest.raises(ValueError, match="unknown reduce op 'avg'"):
        led.all_reduce(torch.ones(2), op="avg")
    with pytest.raises(ValueError, match="reduce_scatter: input has 3 elements"):
        led.reduce_scatter(torch.empty(2), torch.empty(3))
    with pytest.raises(ValueError, match="all_gather: output has 3 elements"):
        led.all_gather(torch.empty(3), torch.empty(2))


# ---- the watchdog: a collective that cannot complete names the op and the ranks that did not arrive


def stuck_rank(timeout):
    led = Ledger(timeout=timeout)
    t = torch.ones(4)
    led.all_reduce(t, tag="warm-up")        # everyone arrives here
    if dist.get_rank() == 1:
        import time
        time.sleep(60)                      # rank 1 hangs
    led.all_reduce(t, tag="bucket0")
    return "done"


def diverging_schedule(timeout):
    led = Ledger(timeout=timeout)
    steps = 3 if dist.get_rank() == 0 else 2  # rank 1 runs one step fewer
    for step in range(steps):
        led.all_reduce(torch.ones(2), tag=f"step{step}")
    return steps


@pytest.mark.slow
def test_stuck_rank_trips_the_ledger_timeout():
    import time
    start = time.monotonic()
    with pytest.raises(zl.LaunchError) as info:
        zl.launch(stuck_rank, 2, args=(2.0,), timeout=60)
    took = time.monotonic() - start
    msg = str(info.value)
    assert info.value.rank == 0 and took < 15, took
    assert "CollectiveTimeout" in msg and "all_reduce 'bucket0'" in msg
    assert "rank 1 (last at #1 all_reduce 'warm-up')" in msg


@pytest.mark.slow
def test_diverging_schedules_are_named():
    with pytest.raises(zl.LaunchError) as info:
        zl.launch(diverging_schedule, 2, args=(2.0,), timeout=60)
    msg = str(info.value)
    assert "all_reduce 'step2' (collective #3 of rank 0)" in msg
    assert "rank 1 (last at #2 all_reduce 'step1')" in msg


def blocking_point_to_point():
    led = Ledger()
    t = torch.zeros(3)
    if dist.get_rank() == 0:
        led.send(torch.arange(3.0), dst=1)
    else:
        led.recv(t, src=0)
    return t.tolist(), led.bytes()


@pytest.mark.slow
def test_blocking_send_and_recv():
    out = zl.launch(blocking_point_to_point, 2)
    assert out == [([0.0, 0.0, 0.0], 12), ([0.0, 1.0, 2.0], 0)], "the sender counts the bytes it sends"
