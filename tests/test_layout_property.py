"""Property test of the flat-buffer layout (zerolab.buckets) and of the checkpoint's description
of it: for random parameter shapes, bucket sizes and world sizes 1..8, the shards tile each
padded buffer, gathering the shards returns every parameter exactly, and the (name, lo, hi)
pieces that zl.checkpoint writes cover every parameter exactly once."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zerolab.buckets import FlatBuckets
from zerolab.engines.state import flat_segments

shapes = st.lists(st.lists(st.integers(1, 6), min_size=0, max_size=3).map(tuple), min_size=1, max_size=7)


@settings(max_examples=60, deadline=None)
@given(shapes=shapes, world_size=st.integers(1, 8), bucket_elems=st.integers(1, 200), seed=st.integers(0, 2**16))
def test_shard_then_gather_returns_every_parameter(shapes, world_size, bucket_elems, seed):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    originals = [p.detach().clone() for p in params]
    fb = FlatBuckets(params, bucket_bytes=4 * bucket_elems, world_size=world_size)

    # every parameter in exactly one bucket, in the given order; no bucket over budget
    assert [id(p) for p in fb.params] == [id(p) for p in params]
    for b in fb.buckets:
        assert b.numel <= bucket_elems or len(b.params) == 1

    names = {id(p): f"p{i}" for i, p in enumerate(params)}
    covered = {f"p{i}": [] for i in range(len(params))}
    for b in fb.buckets:
        # padded to a multiple of N with less than N extra elements
        assert b.padded_numel % world_size == 0 and 0 <= b.padded_numel - b.numel < world_size
        flat = b.flat_copy()
        # the shards tile the buffer: contiguous, equal, disjoint, in rank order
        slices = [b.shard(r) for r in range(world_size)]
        assert slices[0].start == 0 and slices[-1].stop == b.padded_numel
        assert all(s.stop == t.start for s, t in zip(slices, slices[1:]))
        assert len({s.stop - s.start for s in slices}) == 1
        shards = [flat[s].clone() for s in slices]
        gathered = torch.cat(shards)                     # what an all-gather produces
        for p, view in zip(b.params, b.views(gathered)):
            assert torch.equal(view, originals[int(names[id(p)][1:])])
        assert not gathered[b.numel:].any(), "padding is zero"
        # the checkpoint's pieces of each rank's shard cover every element exactly once
        for r, s in enumerate(slices):
            for _, t_lo, name, lo, hi in flat_segments(shards[r], b, s, names):
                covered[name].append((lo, hi))
                value = originals[int(name[1:])].reshape(-1)[lo:hi]
                assert torch.equal(shards[r][t_lo:t_lo + hi - lo], value)
    for i, p in enumerate(params):
        spans = sorted(covered[f"p{i}"])
        at = 0
        for lo, hi in spans:
            assert lo == at, f"p{i}: gap or overlap at {at}"
            at = hi
        assert at == p.numel()

    # binding: parameters become views into one buffer per bucket, values unchanged
    fb.bind_params()
    for p, orig in zip(params, originals):
        assert torch.equal(p.detach(), orig)
        b = fb.buckets[fb.where[p][0]]
        assert p.data.untyped_storage().data_ptr() == b.data.untyped_storage().data_ptr()
