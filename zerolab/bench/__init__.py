"""The benchmark: every zerolab engine beside its PyTorch (and DeepSpeed) peers, one table.

    python -m zerolab bench                 # GPT "small", 2 ranks, 3 interleaved rounds
    python -m zerolab bench --rounds 5      # more rounds: a narrower spread
    python -m zerolab bench --quick         # one round of a few steps, under 2 minutes
    python -m zerolab bench --plot figs/    # also write the figures chapter 10 shows
    python -m zerolab bench --compile       # every model torch.compile'd (inductor) first

Engines, all fp32 with AdamW on the same model, data and processes:

    kind    zerolab        peers
    floor   local          (the plain model and AdamW on each rank's own batch, PyTorch's loop,
                           no wrapper: the per-rank work, with no communication at all)
    DDP     zl.DDP         PyTorch DistributedDataParallel
            (and zl.DDP(bitwise=True): the same weights, bit for bit, at any world size)
    ZeRO-1  zl.ZeRO(1)     ZeroRedundancyOptimizer (+ DDP), DeepSpeed stage 1
    ZeRO-2  zl.ZeRO(2)     FSDP2 reshard_after_forward=False, DeepSpeed stage 2
            (and zl.ZeRO(2, bitwise=True))
    ZeRO-3  zl.ZeRO(3)     FSDP2 reshard_after_forward=True, DeepSpeed stage 3
            (and zl.ZeRO(3, prefetch=0): the same engine without prefetch, to show what it buys)

The two bitwise=True rows (zerolab.engines.options.BITWISE; --no-bitwise leaves them out) show
what the mode costs beside the same engine's default: each step's one backward is one chunk,
its gradient added by a fixed tree across ranks (recursive halving, point to point) and an
all-gather, after a small all-reduce in which the ranks agree on the number of backwards;
AdamW steps with torch's single-tensor kernels (the default mode asks for the foreach path).
They run through zerolab's loop only, on a power-of-two number of ranks, and not under --compile.

Each zerolab engine runs twice, each copy on its own model: through zerolab's loop
(`engine.backward(loss); engine.step(); engine.zero_grad()`) and, as "NAME [PyTorch loop]",
through PyTorch's (`loss.backward(); optimizer.step(); optimizer.zero_grad()`), which is what a
PyTorch user's script runs. The peers run their own loops.

DeepSpeed runs only when it is installed and can start on this machine; otherwise the table
says why. Every engine that has buckets gets the same size (bucket_mb): zerolab's, PyTorch
DDP's bucket_cap_mb and DeepSpeed's reduce/all-gather buckets (deepspeed_config). Every rank
builds every engine from the same seed and runs them in turn step by step, in a new shuffled
order each step (interleaved, so a slow moment of the machine hits them all
alike; shuffled, not rotated, so no engine always runs right after the same other one and
inherits, say, the allocator state it left behind). That is one round; --rounds N runs N of
them, each in fresh processes, and every timing comes with its lowest and highest round.

What each column measures:
  loop         what drives the engine: zerolab's loop, PyTorch's, or DeepSpeed's engine.backward/step
  step time    median over timed steps of the slowest rank's time for one step
               (forward, backward, optimizer step, zero_grad); in brackets, with several
               rounds, the lowest and highest of the rounds' medians. Each round runs in
               fresh processes: the bracket is the run-to-run noise, and a difference inside
               it is not a finding (the same for the two ratios below)
  vs floor     per round, the engine's median step / the floor's median step; the median over
               rounds (in brackets the lowest and highest round)
  vs best peer the same against the fastest peer of the same kind (zerolab rows only); for
               zl.ZeRO-3 prefetch=0 and the bitwise rows, against the same engine's default
  held, peak   bytes this rank held when a step began, and the most it held at any moment of
               the step: everything the engine allocated since it was built (model, optimizer
               state, gradients, communication buffers, activations), counted by malloc
               after every op (zerolab.memory.MallocTrace). Each engine is built alone for
               this, in the last round, so no engine's memory is counted for another. A
               "[PyTorch loop]" row shows its engine's memory measured through zerolab's loop
               (the same storages and the same step; measured once to keep the run short)
  bytes/step   bytes this rank wrote to gloo's sockets during one step, read from the
               operating system (/proc/self/io), so it is measured the same way for every engine
  ledger       zerolab only: the bytes its ledger books for the step under the ring model
               (gloo implements reduce-scatter with an all-reduce, so the wire carries more)
  final loss   the last step's loss, mean over ranks; all distributed engines must agree

Under the table, one line says what zerolab's instruments (the ledger, its flight recorder and its
watchdog) add to each collective, from a measurement of its own (zerolab.bench.overhead); the
targets follow, and last the ratios: each zerolab engine, through each loop, over its best peer
and over the floor, then each bitwise row over its default (zerolab.bench.report.format_ratios).
Before them, the bitwise rows' bytes per step, as the ledger booked them, beside the closed form
zerolab.bench.report.bitwise_bytes: 2 (N-1)/N x 4 B x the padded gradient (the tree's recursive
halving, then the all-gather) + 2 (N-1)/N x 8 B x (2 + T), the agreement all-reduce of K, -K and
one flag per trainable tensor (T of them); exact, as every ledger figure is.
"""

from .engines import BITWISE_ROWS, FLOOR, KINDS, LOOPS, ZEROLAB, Runner, bitwise_layout, build_runners, \
    engine_factories, make_zerolab, pytorch_loop_name
from .peers import DEEPSPEED_GRADIENT_CLIPPING, deepspeed_config, fsdp2, quiet_deepspeed, torch_ddp, zero_redundancy
from .report import COUNT_COLUMNS, TIMING_COLUMNS, bitwise_bytes, format_bitwise_bytes, format_ratios, format_table, \
    summarize, targets
from .overhead import format_overhead, measure as measure_overhead
from .run import GPU_NOTE, bench_worker, bitwise_left_out, main, measure_memory, run, written_bytes

__all__ = ["BITWISE_ROWS", "bitwise_bytes", "bitwise_left_out", "bitwise_layout", "format_bitwise_bytes", "DEEPSPEED_GRADIENT_CLIPPING", "FLOOR", "KINDS", "LOOPS", "pytorch_loop_name", "format_ratios", "ZEROLAB", "Runner", "build_runners", "deepspeed_config", "engine_factories", "make_zerolab",
           "quiet_deepspeed", "COUNT_COLUMNS", "TIMING_COLUMNS", "format_table", "summarize", "targets",
           "GPU_NOTE", "bench_worker", "main", "measure_memory", "run", "written_bytes", "format_overhead",
           "measure_overhead", "fsdp2", "torch_ddp", "zero_redundancy"]
