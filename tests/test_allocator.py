"""The caching-allocator model: an exact hand-made fragmentation case, and a real step's trace."""

import torch

from zerolab import memory
from zerolab.theory import allocator
from zerolab.data import CharDataset
from zerolab.memory import TraceEvent
from zerolab.models import GPT, gpt_config, gpt_loss


def _trace(events):
    """events: ("+", name, bytes) or ("-", name) -> TraceEvents with block ids."""
    ids, sizes, out = {}, {}, []
    for i, e in enumerate(events):
        if e[0] == "+":
            ids[e[1]] = len(ids) + 1
            sizes[e[1]] = e[2]
            out.append(TraceEvent(i, e[2], "alloc", ids[e[1]]))
        else:
            out.append(TraceEvent(i, -sizes[e[1]], "free", ids[e[1]]))
    return out, ids


# short-lived A and C interleaved with long-lived B and D, then a request as big as A + C
CASE = [("+", "A", 100), ("+", "B", 100), ("+", "C", 100), ("+", "D", 100),
        ("-", "A"), ("-", "C"), ("+", "E", 200), ("-", "E"), ("-", "B"), ("-", "D")]


def test_known_fragmentation_case_exactly():
    trace, ids = _trace(CASE)
    plain = allocator.replay(trace, round_to=1)
    # by hand: A|B|C|D fill 0..400; freeing A and C leaves two 100-byte holes (200 free, none
    # contiguous), so E (200) goes to the end: the arena reaches 600 for a peak of 400 live bytes
    assert (plain.peak_live, plain.reserved) == (400, 600)
    assert (plain.stranded, plain.free_then, plain.largest_free_then) == (200, 200, 100)
    assert plain.fragmentation == 1 - 400 / 600
    capped = allocator.replay(trace, round_to=1, capacity=400)
    assert capped.failed_at == 6, "E fails although 200 bytes are free"

    # M_D: B and D come from a pre-allocated contiguous region; A and C's holes merge; E fits
    md = allocator.replay(trace, round_to=1, defragment={ids["B"], ids["D"]}, capacity=400)
    assert (md.peak_live, md.reserved, md.stranded, md.failed_at) == (400, 400, 0, None)


def test_rounding_and_coalescing():
    arena = allocator.Arena(round_to=512)
    assert arena.malloc(1, 1) and arena.malloc(2, 600) and arena.malloc(3, 10)
    assert arena.end == 512 + 1024 + 512
    arena.release(2)
    arena.release(1)
    assert arena.free == [(0, 1536)], "neighbouring free blocks merge into one"
    assert arena.malloc(4, 1500) and arena.end == 2048, "the merged hole is reused"


def test_long_lived_classification():
    trace, ids = _trace(CASE)
    # B and D live through most of the trace; A, C and E come and go
    assert allocator.long_lived(trace, fraction=0.5) == {ids["B"], ids["D"]}


def test_replaying_a_real_training_step():
    torch.manual_seed(0)
    model = GPT(gpt_config("nano"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = CharDataset(32).batch(0, 4)
    with memory.AllocationTracker(record_trace=True) as tracker:
        _, loss = gpt_loss(model, batch)
        loss.backward()
        opt.step()
    result = allocator.replay(tracker.trace, round_to=1)
    # the replay's live-byte count is the tracker's own peak, independently summed from the events
    assert result.peak_live == tracker.peak
    assert result.reserved >= result.peak_live
    md = allocator.replay(tracker.trace, round_to=1, defragment=allocator.long_lived(tracker.trace))
    assert md.peak_live == result.peak_live
