"""The bitwise mode: the same weights, bit for bit, on 1, 2, 4 or 8 ranks.

Floating-point addition is not associative, so a data-parallel step that adds the same
numbers in another order (a rank's share of the batch summed inside one matmul, the ring
adding the ranks' sums, per-shard squares added for the clip's norm) ends with other low bits.
This package fixes every order of addition so that the world size no longer changes any bit:

    chunks      the global batch cut into a fixed number of chunks (independent of the world
                size); each chunk's gradient computed on its own; rank r owns a contiguous run
    flat        the trainable parameters as one padded flat vector, cut into equal shards
    tree        the chunks' gradients added in ONE fixed binary tree over chunk indices:
                inside a rank, then across ranks by recursive halving and an all-gather
    norm        the squared norm, exact (integer digits), for clipping: no order can matter
    trainer     a small data-parallel trainer on top (SGD, AdamW; accumulation; clipping;
                fp32 or bf16 compute with fp32 masters), whole vector or ZeRO-style shards
    bits        how many bits differ between two sets of weights
    drift       the default path (zl.DDP) against the bitwise mode: differing bits against N
    cost        the bitwise step's time and bytes beside zl.DDP's ring all-reduce
(drift and cost launch ranks and use zl.DDP: import them by name; the rest is below the engines.)
"""

from .bits import differing_bits
from .chunks import ChunkPlan, chunk_gradient
from .flat import FlatLayout
from .norm import clip_coefficient, exact_sum_of_squares
from .trainer import BitwiseDataParallel
from .tree import TreeAccumulator, tree_all_reduce, tree_reduce_scatter, tree_sum

__all__ = ["ChunkPlan", "chunk_gradient", "FlatLayout", "TreeAccumulator", "tree_sum", "tree_all_reduce",
           "tree_reduce_scatter", "exact_sum_of_squares", "clip_coefficient",
           "BitwiseDataParallel", "differing_bits"]
