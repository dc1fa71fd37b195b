"""The flat bucket layout: views, reverse order, padding, shards (single process, no ranks)."""

import pytest
import torch

from zerolab.buckets import FlatBuckets, bucket_order
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
