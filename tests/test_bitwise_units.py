"""zerolab.bitwise's pieces, each checked with torch.equal (no tolerance anywhere):

* the chunk plan refuses, by name, what the fixed tree cannot make exact;
* TreeAccumulator (chunks fed in micro-batches) forms the same bits as the recursive tree,
  and the test has teeth: a left-to-right sum of the same chunks does not;
* across 1, 2, 4 and 8 gloo ranks, tree_reduce_scatter and tree_all_reduce give the bits of
  the one-process tree sum, while torch.distributed's own all-reduce of the same partial sums
  does not (on some world size);
* the block norm is the same bits on a whole vector, on shards (in one process and on 1, 2, 4,
  8 ranks, each holding a shard), and with any zero padding;
* the premise of layout independence: SGD and AdamW (foreach=False) on a slice at any offset
  give the same bits as on the whole vector, on this CPU's kernel set;
* differing_bits counts bits exactly.
"""

import functools

import pytest
import torch
import torch.distributed as dist

import zerolab as zl
from zerolab.bitwise import (BitwiseDataParallel, ChunkPlan, TreeAccumulator, differing_bits,
                             fixed_order_sum_of_squares, tree_all_reduce, tree_reduce_scatter, tree_sum)
from zerolab.bitwise.norm import block_sums_of_squares, halving_sum
from zerolab.runtime.comm import Ledger
from zerolab.models import TinyMLP, regression_loss

CHUNKS = 16
LENGTH = 8 * 96       # a multiple of every world size's shards


def spread_chunks(count=CHUNKS, length=LENGTH, seed=0):
    """Chunk 'gradients' whose magnitudes span 2^-12..2^12, so any change of grouping shows."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(length, generator=g) * 2.0 ** torch.randint(-12, 13, (length,), generator=g)
            for _ in range(count)]


def left_to_right(tensors):
    total = tensors[0].clone()
    for t in tensors[1:]:
        total = total + t
    return total


# ------------------------------------------------------------------ the plan's refusals


@pytest.mark.parametrize("chunks, world, words", [
    (12, 4, "num_chunks must be a power of two"),
    (16, 3, "world size must be a power of two"),
    (4, 8, "must be a multiple of the world size"),
    (0, 1, "num_chunks must be a power of two"),
])
def test_plan_refuses_by_name(chunks, world, words):
    with pytest.raises(ValueError, match=words):
        ChunkPlan(chunks, world)


def test_plan_refuses_a_batch_the_chunks_do_not_divide():
    plan = ChunkPlan(16, 4)
    assert plan.chunk_rows(32) == 2 and plan.rank_rows(32, 3).tolist() == list(range(24, 32))
    assert list(plan.chunks_of(1)) == [4, 5, 6, 7]
    interleaved = ChunkPlan(16, 4, interleaved=True)
    assert list(interleaved.chunks_of(1)) == [1, 5, 9, 13]
    assert interleaved.rank_rows(32, 1).tolist() == [2, 3, 10, 11, 18, 19, 26, 27]
    with pytest.raises(ValueError, match="cannot be cut into 16 equal chunks"):
        plan.chunk_rows(40)


# ------------------------------------------------------------------ the tree in one process


@pytest.mark.parametrize("count", [1, 2, 4, 8, 16])
def test_accumulator_is_the_recursive_tree(count):
    chunks = spread_chunks(count)
    acc = TreeAccumulator(count)
    for c in chunks:
        acc.add(c.clone())
    assert torch.equal(acc.result(), tree_sum(chunks))


def test_the_order_matters_so_the_tests_can_see_it():
    chunks = spread_chunks()
    assert not torch.equal(left_to_right(chunks), tree_sum(chunks))


def test_accumulator_refuses_an_incomplete_or_overfull_tree():
    acc = TreeAccumulator(4)
    with pytest.raises(ValueError, match="power of two"):
        TreeAccumulator(6)
    acc.add(torch.ones(3))
    with pytest.raises(RuntimeError, match="1 of 4 leaves added"):
        acc.result()
    for _ in range(3):
        acc.add(torch.ones(3))
    with pytest.raises(RuntimeError, match="already added"):
        acc.add(torch.ones(3))


# ------------------------------------------------------------------ the tree across ranks


def tree_worker():
    """Each rank adds its own chunks in its subtree, then the ranks add across in the tree."""
    r, n = dist.get_rank(), dist.get_world_size()
    plan = ChunkPlan(CHUNKS, n)
    chunks = spread_chunks()
    acc = TreeAccumulator(plan.chunks_per_rank)
    for i in plan.chunks_of(r):
        acc.add(chunks[i].clone())
    local = acc.result()
    ledger = Ledger()
    full = tree_all_reduce(local.clone(), ledger)
    shard = tree_reduce_scatter(local.clone(), ledger)
    plain = local.clone()
    dist.all_reduce(plain)          # the library's own order (gloo's algorithm)
    sent = ledger.bytes(op="send")
    x = norm_vector()
    norm = fixed_order_sum_of_squares(x.view(n, -1)[r], NORM_BLOCK, ledger, sharded=True)
    return full, shard, plain, sent, norm


NORM_BLOCK = 64


def plain_block_norm(x, block):
    """The norm's order written out: squares, each block halved to one, the block sums halved to one."""
    v = (x * x).view(-1, block)
    while v.shape[-1] > 1:
        v = v[:, :v.shape[-1] // 2] + v[:, v.shape[-1] // 2:]
    v = v[:, 0]
    while v.numel() > 1:
        v = v[:v.numel() // 2] + v[v.numel() // 2:]
    return v[0]


def norm_vector():
    """A vector whose squares' sum changes with the order of addition (4096: 8 shards of 8 blocks)."""
    return torch.randn(4096, generator=torch.Generator().manual_seed(3))


@pytest.mark.slow
def test_tree_across_ranks_is_the_one_process_tree():
    reference = tree_sum(spread_chunks())
    plain_differs = []
    for n in (1, 2, 4, 8):
        results = zl.launch(tree_worker, n)
        for r, (full, shard, plain, sent, norm) in enumerate(results):
            assert torch.equal(norm, plain_block_norm(norm_vector(), NORM_BLOCK)), f"norm at N={n}"
            assert torch.equal(full, reference), f"all-reduce at N={n}, rank {r}"
            assert torch.equal(shard, reference.view(n, -1)[r]), f"reduce-scatter at N={n}, rank {r}"
            # recursive halving sends (N-1)/N of the vector per rank (the ring's bytes), twice for
            # tree_all_reduce (its own reduce-scatter) plus once for tree_reduce_scatter
            assert sent == 2 * (n - 1) * LENGTH * 4 // n, (n, sent)
        plain_differs.append(not torch.equal(results[0][2], reference))
    assert any(plain_differs), "gloo's all-reduce happened to add in the tree's order at every N"


# ------------------------------------------------------------------ the norm


def test_block_norm_is_the_same_on_shards_and_with_any_padding():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3000, generator=g) * 2.0 ** torch.randint(-8, 9, (3000,), generator=g)
    block = 64
    totals = []
    for world in (1, 2, 4, 8):
        padded = -(-x.numel() // (world * block)) * world * block
        flat = torch.cat([x, x.new_zeros(padded - x.numel())])
        whole = fixed_order_sum_of_squares(flat, block)
        # what a sharded rank does: its blocks' sums, concatenated in rank order, then the tree
        shards = flat.view(world, -1)
        gathered = torch.cat([block_sums_of_squares(s, block) for s in shards])
        totals += [whole, halving_sum(gathered)]
    assert all(torch.equal(t, totals[0]) for t in totals)
    # teeth: the sharded engines' order (each shard's squares summed by torch, then the shards'
    # sums added) changes with the world size on the same data
    y = torch.randn(3000, generator=g)
    naive = {(y.view(world, -1) ** 2).sum(dim=1).sum().item() for world in (1, 2, 4, 8)}
    assert len(naive) > 1, naive


# ------------------------------------------------------------------ layout independence of the update


@pytest.mark.parametrize("make", [
    functools.partial(torch.optim.SGD, lr=1e-2, momentum=0.9, weight_decay=0.01, foreach=False),
    functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.1, foreach=False),
], ids=["sgd", "adamw"])
def test_elementwise_update_is_the_same_on_any_slice(make):
    g = torch.Generator().manual_seed(2)
    w, grads = torch.randn(4099, generator=g), [torch.randn(4099, generator=g) for _ in range(3)]

    def stepped(lo, hi):
        p = w[lo:hi].clone().requires_grad_()
        opt = make([p])
        for gr in grads:
            p.grad = gr[lo:hi].clone()
            opt.step()
        return p.detach()

    whole = stepped(0, w.numel())
    for lo, hi in [(1, 38), (3, 64), (17, 4099), (0, 7), (1000, 3001)]:
        assert torch.equal(stepped(lo, hi), whole[lo:hi]), (lo, hi)


def test_trainer_refuses_what_it_cannot_make_exact():
    plan = ChunkPlan(4, 1)
    cases = [(functools.partial(torch.optim.AdamW, lr=1e-3, foreach=True), "fp32", "foreach=False"),
             (torch.optim.Adafactor, "fp32", "not one of SGD, Adam, AdamW"),
             (torch.optim.SGD, "fp16", "fp16 is not supported")]
    for make, precision, words in cases:
        with pytest.raises(ValueError, match=words):
            BitwiseDataParallel(TinyMLP(), functools.partial(make, lr=1e-2) if make is torch.optim.SGD else make,
                                regression_loss, plan, precision=precision)
    with pytest.raises(ValueError, match="chunk plan is for 2 ranks"):
        BitwiseDataParallel(TinyMLP(), torch.optim.AdamW, regression_loss, ChunkPlan(4, 2))


# ------------------------------------------------------------------ counting bits


def test_differing_bits_counts_exactly():
    a = torch.zeros(5)
    b = a.clone()
    b[1] = -0.0                                          # the sign bit
    b[3] = torch.tensor(1, dtype=torch.int32).view(torch.float32)   # the lowest mantissa bit
    c = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    d = torch.tensor([1.0, 3.0], dtype=torch.bfloat16)      # 2 = 0x4000, 3 = 0x4040: one bit
    counts = differing_bits({"a": a, "c": c}, {"a": b, "c": d})
    assert counts == {"a": {"numel": 5, "elements": 2, "bits": 2}, "c": {"numel": 2, "elements": 1, "bits": 1}}
    assert differing_bits({"a": a}, {"a": a.clone()})["a"]["bits"] == 0


def uneven_threads_worker():
    torch.set_num_threads(1 + dist.get_rank())
    BitwiseDataParallel(TinyMLP(), torch.optim.AdamW, regression_loss, ChunkPlan(4, dist.get_world_size()))


@pytest.mark.slow
def test_ranks_with_different_thread_counts_are_refused():
    # a CPU matmul splits its work by thread: 1 and 2 threads give a chunk other bits
    with pytest.raises(zl.LaunchError, match="between 1 and 2 threads"):
        zl.launch(uneven_threads_worker, 2)
