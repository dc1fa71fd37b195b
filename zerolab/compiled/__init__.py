"""ZeRO seen by a compiler: the training step as an FX graph, and ZeRO as passes over it (chapter 16).

    capture.py      the forward and backward of one step as one graph, with make_fx
    shard.py        (a) parameters as shards: all-gather before the first reader, free after the last
    reduce.py       (b) each gradient reduce-scattered where it is produced (ZeRO-2) or at the end (ZeRO-1)
    bucket.py       (c) neighbouring collectives merged, up to a size
    prefetch.py     (d) each all-gather started a few operations early
    liveness.py     (e) the step's memory, allocation by allocation, predicted from the graph
    collectives.py  what the graph's collective nodes call, through zerolab's ledger
    nodes.py        what a pass needs to know about a node (a view or new memory, where it is)
    zero.py         ZeRO-1, 2 and 3 as lists of passes, and the loop that trains with the graph
    runs.py         workers for zl.launch: the graph against eager zl.ZeRO, and memory

    step = zero_step(model, loss_fn, batch, stage=3, world=N, bucket_bytes=1 << 16, depth=2)
    liveness(step).peak           # bytes, before anything runs
"""

from .capture import Step, capture
from .liveness import liveness
from .zero import Trainer, zero_step

__all__ = ["Step", "capture", "liveness", "Trainer", "zero_step"]
