"""The flat bucket layout: views, reverse order, padding, shards (single process, no ranks)."""

import pytest
import torch

from zerolab.buckets import FlatBuckets, bucket_order, held_still, unreached_ranges
from zerolab.models import AwkwardModel, GPT, gpt_config


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_params_and_grads_become_views_of_padded_buffers(world_size):
    torch.manual_seed(0)
    model = AwkwardModel()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    order = bucket_order(model)
    fb = FlatBuckets(order, bucket_bytes=200, world_size=world_size)
    fb.bind_params()
    fb.bind_grads()
    assert len(fb) > 1
    # the frozen layer is left out; the tied weight appears once
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert [id(p) for p in fb.params] == [id(p) for p in order] and set(map(id, fb.params)) == trainable
    for b in fb.buckets:
        assert b.padded_numel % world_size == 0 and 0 <= b.padded_numel - b.numel < world_size
        base_p, base_g = b.data.data_ptr(), b.grad.data_ptr()
        for p, off in zip(b.params, b.offsets):
            assert p.data_ptr() == base_p + off * p.element_size()
            assert p.grad.data_ptr() == base_g + off * p.grad.element_size()
        # shards tile the padded buffer exactly
        pieces = [b.shard(r) for r in range(world_size)]
        assert pieces[0].start == 0 and pieces[-1].stop == b.padded_numel
        assert all(a.stop == c.start for a, c in zip(pieces, pieces[1:]))
        assert torch.count_nonzero(b.data[b.numel:]) == 0  # padding is zeros
    # values survive the move into the buffers
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n


def test_reverse_forward_order_and_accumulation_into_buckets():
    torch.manual_seed(0)
    model = GPT(gpt_config("nano"))
    fb = FlatBuckets(bucket_order(model), bucket_bytes=30_000, world_size=2)
    fb.bind_params()
    fb.bind_grads()
    # the output head is used last in forward, so it is first in bucket 0
    assert fb.buckets[0].params[0] is model.head.weight
    assert fb.buckets[-1].params[-1] is model.tok_emb.weight
    # autograd accumulates into the views, so the flat buffer holds the gradient
    ref = GPT(gpt_config("nano"))
    ref.load_state_dict(model.state_dict())
    x = torch.randint(0, 96, (2, 16))
    for m in (model, ref):
        m(x).float().pow(2).mean().backward()
        m(x).float().pow(2).mean().backward()   # twice: accumulation, not replacement
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        b, i = fb.where[p]
        assert p.grad.data_ptr() == fb.buckets[b].grad_view(i).data_ptr(), n
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    fb.zero_grads()
    assert all(torch.count_nonzero(b.grad) == 0 for b in fb.buckets)


def test_one_parameter_bigger_than_a_bucket_gets_its_own():
    ps = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 1000, 10)]
    fb = FlatBuckets(ps, bucket_bytes=100, world_size=4)
    assert [len(b.params) for b in fb.buckets] == [1, 1, 1]
    with pytest.raises(ValueError, match="bucket_bytes"):
        FlatBuckets(ps, bucket_bytes=0, world_size=2)
    with pytest.raises(ValueError, match="no parameters"):
        FlatBuckets([], bucket_bytes=10, world_size=2)


@pytest.mark.parametrize("opt, unused_sometimes", [
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1), True),
    (lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1), False),
])
@pytest.mark.parametrize("world_size", [1, 3])
def test_an_optimizer_on_flat_slices_equals_one_per_parameter(opt, unused_sometimes, world_size):
    """The flat layout DDP and ZeRO step on, against a per-parameter optimizer that skips
    parameters whose gradient is None. SGD keeps no step counter, so even a parameter unused
    in SOME steps must match exactly; AdamW's shared counter is exact for always-unused ones."""
    torch.manual_seed(0)
    shapes = [(3, 5), (7,), (2, 2, 2), (11,), (4, 3)]
    values = [torch.randn(s) for s in shapes]
    ref = [v.clone() for v in values]
    ref_opt = opt(ref)
    params = [torch.nn.Parameter(v.clone()) for v in values]
    fb = FlatBuckets(params, bucket_bytes=100, world_size=world_size)
    fb.bind_params()
    assert len(fb) > 1
    rank = world_size - 1          # the last rank's slices: they cut through parameters
    shards = [b.shard(rank) for b in fb.buckets]
    flats = [b.data[s] for b, s in zip(fb.buckets, shards)]
    flat_opt = opt(flats)
    for step in range(4):
        unused = {1, 3} if (step % 2 == 0 or not unused_sometimes) else set()
        grads = [torch.randn(s) for s in shapes]
        for k, (p, g) in enumerate(zip(ref, grads)):
            p.grad = None if k in unused else g
        ref_opt.step()
        flat_grads = [torch.zeros(b.padded_numel) for b in fb.buckets]
        for k, (p, g) in enumerate(zip(params, grads)):
            b, i = fb.where[p]
            if k not in unused:
                fb.buckets[b].views(flat_grads[b])[i].copy_(g)
        for f, g, s in zip(flats, flat_grads, shards):
            f.grad = g[s]
        with held_still(flat_opt, [(flats[b], lo, hi) for b, lo, hi in unreached_ranges(fb, unused, shards)]):
            flat_opt.step()
    position = {id(p): k for k, p in enumerate(params)}
    moved = 0
    for b, s in zip(fb.buckets, shards):
        for p, o, n in zip(b.params, b.offsets, b.sizes):
            lo, hi = max(o, s.start), min(o + n, s.stop)
            if lo < hi:   # the part of p this rank owns and updated
                k = position[id(p)]
                mine, want = p.detach().reshape(-1)[lo - o:hi - o], ref[k].reshape(-1)[lo - o:hi - o]
                # one flat AdamW against per-tensor ones: the same elementwise arithmetic, but
                # torch may vectorise a flat tensor's ops differently (a few ulp at most)
                torch.testing.assert_close(mine, want, rtol=1e-6, atol=1e-7)
                moved += int(not torch.equal(want, values[k].reshape(-1)[lo - o:hi - o]))
    assert moved > 0   # the check compared something that trained
