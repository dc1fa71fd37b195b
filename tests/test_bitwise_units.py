"""zerolab.bitwise's pieces, each checked with torch.equal (no tolerance anywhere):

* the chunk plan refuses, by name, what the fixed tree cannot make exact;
* TreeAccumulator (chunks fed in micro-batches) forms the same bits as the recursive tree,
  and the test has teeth: a left-to-right sum of the same chunks does not;
* across 1, 2, 4 and 8 gloo ranks, tree_reduce_scatter and tree_all_reduce give the bits of
  the one-process tree sum, while torch.distributed's own all-reduce of the same partial sums
  does not (on some world size);
* the exact norm is math.fsum's, to the last bit, on a whole vector and on shards of any size and
  order (in one process, and on 1, 2, 4, 8 ranks each holding a shard);
* the premise of layout independence: SGD and AdamW (foreach=False) on a slice at any offset
  give the same bits as on the whole vector, on this CPU's kernel set;
* differing_bits counts bits exactly.
"""

import functools
import math

import pytest
import torch
import torch.distributed as dist

import zerolab as zl
from zerolab.bitwise import (BitwiseDataParallel, ChunkPlan, TreeAccumulator, differing_bits,
                             exact_sum_of_squares, tree_all_reduce, tree_reduce_scatter, tree_sum)
from zerolab.bitwise.norm import square_sums, sums_to_float
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
    norm = exact_sum_of_squares(x.view(n, -1)[r], ledger, sharded=True)
    return full, shard, plain, sent, norm


def fsum_norm(x) -> torch.Tensor:
    """The reference: math.fsum of the fp64 squares (each exact: 24-bit mantissas squared fit in
    53 bits), correctly rounded to fp64, then cast to fp32."""
    return torch.tensor(math.fsum(v * v for v in x.double().tolist()), dtype=torch.float64).float()


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
            assert torch.equal(norm, fsum_norm(norm_vector())), f"norm at N={n}"
            assert torch.equal(full, reference), f"all-reduce at N={n}, rank {r}"
            assert torch.equal(shard, reference.view(n, -1)[r]), f"reduce-scatter at N={n}, rank {r}"
            # recursive halving sends (N-1)/N of the vector per rank (the ring's bytes), twice for
            # tree_all_reduce (its own reduce-scatter) plus once for tree_reduce_scatter
            assert sent == 2 * (n - 1) * LENGTH * 4 // n, (n, sent)
        plain_differs.append(not torch.equal(results[0][2], reference))
    assert any(plain_differs), "gloo's all-reduce happened to add in the tree's order at every N"


# ------------------------------------------------------------------ the norm


def spread_values(count: int, seed: int) -> torch.Tensor:
    """Values over 2^-60 .. 2^60, subnormal, zero and negative ones among them: squares whose
    sum changes with the order of addition."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(count, generator=g) * 2.0 ** torch.randint(-60, 61, (count,), generator=g)
    x[:5] = torch.tensor([0.0, -0.0, 1e-45, -3e-40, 2.0 ** -100])
    return x


def test_exact_norm_is_fsum_on_any_split_and_order():
    x = spread_values(3000, 1)
    reference = fsum_norm(x)
    assert torch.equal(exact_sum_of_squares(x), reference)
    exact_fp64 = math.fsum(v * v for v in x.double().tolist())
    assert sums_to_float(square_sums(x)) == exact_fp64      # correctly rounded, to the last bit
    g = torch.Generator().manual_seed(2)
    for world in (2, 3, 4, 8):              # shards of any size, in any order: integer sums add exactly
        pieces = list(x[torch.randperm(x.numel(), generator=g)].tensor_split(world))
        sums = sum(square_sums(p) for p in pieces)
        assert sums_to_float(sums) == exact_fp64
        assert torch.equal(exact_sum_of_squares(pieces), reference)
    # bf16 gradients read exactly too (each is an fp32 value)
    b = x.clamp(-1e30, 1e30).bfloat16()
    assert torch.equal(exact_sum_of_squares(b), fsum_norm(b.float()))
    # teeth: the sharded engines' plain order (each shard's squares summed by torch, then the
    # shards' sums added) changes with the world size on the same data
    y = torch.randn(3000, generator=g)
    naive = {(y.view(world, -1) ** 2).sum(dim=1).sum().item() for world in (1, 2, 4, 8)}
    assert len(naive) > 1, naive


def test_exact_norm_of_nan_and_inf_is_nan_and_inf():
    assert math.isinf(float(exact_sum_of_squares(torch.tensor([1.0, float("inf")]))))
    assert math.isnan(float(exact_sum_of_squares([torch.tensor([float("inf")]), torch.tensor([float("nan")])])))
    assert float(exact_sum_of_squares(torch.zeros(7))) == 0.0
    # the largest fp32 squared overflows fp32, as torch's norm does (its sums hold it exactly)
    big = torch.tensor([3.4e38])
    assert sums_to_float(square_sums(big)) == float(big.double()) ** 2
    assert math.isinf(float(exact_sum_of_squares(big)))


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
