"""bitwise=True on an engine (engines.options.BITWISE): what every engine with the mode shares.

A mixin of engines.base.Engine. Each backward is one chunk of the global batch; its gradient goes
into the chunks' fixed tree when the backward ends (the engine's _add_chunk / _finish_backward),
and the step's gradient is the tree's sum across ranks (_chunk_sum). Here: the checks of the
world the mode needs, p.grad's placeholders between a backward and the step
(engines.chunk_grad), and the norm a clip reads.
"""

from __future__ import annotations

from ..bitwise.buckets import check_same_threads
from ..bitwise.norm import exact_sum_of_squares
from ..bitwise.chunks import is_power_of_two
from . import chunk_grad


class BitwiseMode:
    """bitwise=True's shared parts (see the module docstring)."""

    bitwise = False             # bitwise=True: the same bits at any world size (engines.options.BITWISE)
    takes_bitwise = False       # does this engine have the bitwise mode? (others refuse it by name)
    _placeholders_out = False   # does p.grad hold placeholders (between a chunk and the step)?

    def _check_bitwise_world(self) -> None:
        """bitwise=True: N a power of two, and the same intra-op threads on every rank."""
        if not is_power_of_two(self.world_size):
            raise ValueError(f"bitwise=True needs a power-of-two number of ranks (1, 2, 4, 8, ...), got "
                             f"{self.world_size}: each rank's chunks must be one subtree of the fixed tree")
        if self.world_size > 1:
            check_same_threads(self.comm)

    def _chunk_done(self, leaves) -> None:
        """A backward's gradient, bucket by bucket in fp32, is this rank's next leaf of each
        bucket's tree; p.grad becomes a placeholder (the real one is freed for the next chunk)."""
        self._trees.add(leaves)
        self._hand_out_placeholders()

    def _hand_out_placeholders(self) -> None:
        chunk_grad.hand_out(self._trainable())
        self._placeholders_out = True

    _sums_out = False           # does p.grad hold the step's sums (zl.DDP without an optimizer)?

    def _take_back_placeholders(self) -> None:
        """Before the next chunk's backward: the placeholders go; the script removed them all
        (model.zero_grad(), p.grad = None): it zeroed the step's chunks so far."""
        if self._sums_out:          # the last step's sums must be gone: they are not a chunk
            if any(p.grad is not None for p in self._trainable()):
                raise RuntimeError("bitwise=True: p.grad still holds the gradients the last synced backward "
                                   "wrote (the fixed tree's average of the step's chunks), and a backward cannot "
                                   "add to them. Run a step's chunks before the last inside engine.no_sync() (or "
                                   "with require_backward_grad_sync = False), and call optimizer.zero_grad() "
                                   "after each step.")
            self._sums_out = False
        if self._placeholders_out:
            self._placeholders_out = False
            if chunk_grad.take_back(self._trainable()) == "zeroed":
                self.zero_grad()

    def _chunk_sum(self) -> list:
        """bitwise=True: the step's fp32 gradient per bucket (whole, or this rank's shard), the
        chunks added in the fixed tree and divided by N; computed once per step."""
        raise NotImplementedError

    def _clear_placeholders(self) -> None:
        """The step made the gradients, or zero_grad() dropped them: the placeholders go."""
        if self._placeholders_out:
            self._placeholders_out = False
            chunk_grad.clear(self._trainable())

    def _chunk_tensors(self) -> list:
        """The gradients the mode holds now: the trees' partial sums, and the step's sums."""
        if not self.bitwise:
            return []
        return self._trees.held() + list(self._summed or [])

    def _chunk_norm(self) -> float:
        """The norm of the step's gradient, the chunks' sum, exact (zerolab.bitwise.norm)."""
        return float(exact_sum_of_squares(self._chunk_sum(), self.comm, self.sharded).sqrt())
