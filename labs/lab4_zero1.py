"""Lab 4: ZeRO-1: reduce-scatter the gradients, step the owned slice, all-gather the parameters
(chapter 6).

Write the four methods below. ZeRO1Lab is zl.ZeRO(stage=1) with them left out; its docstring lists
what you can use (zerolab.labs.zero1.ZeRO1Lab). The reducer that calls them (chapter 5's hooks, the
buckets launched in order after backward) and the step are the library's. The grader trains a
small model in fp32 with AdamW on 2 ranks and compares with one process on the global batch.

    python -m zerolab.labs grade zero1 labs/lab4_zero1.py
"""

import torch

from zerolab.labs.zero1 import ZeRO1Lab


class MyZeRO1(ZeRO1Lab):
    def _lay_out_masters(self):
        """Decide, once, what this rank owns and its optimizer updates (fp32 training).

        self.shards (a list you create, one slice per bucket): this rank's part of bucket b is
        self.shards[b]. Cut each bucket's PADDED flat buffer
        (bucket.padded_numel elements, a multiple of N) into N equal contiguous slices, slice r for
        rank r: the parts a reduce-scatter hands out. Then make every parameter a view into its
        bucket's flat buffer (self.buckets.bind_params()) and set self.master_shards[b], the tensor
        the optimizer updates for bucket b: the owned slice of bucket.data itself (a view, so the
        optimizer updates the model's own weights; a copy would be updated and never reach the
        model). Then set self.flat_masters and self.masters to that same list (the step and the
        reducer read them under those names). Set self._out = {} if you use it."""
        raise NotImplementedError("_lay_out_masters")

    def _reduce(self, b):
        """Bucket b's gradient is complete. Start the reduce-scatter of its flat gradient
        (flat = self._grad_bucket(b), after self._ready_to_reduce(b, flat), which divides by N) into
        a new tensor of padded_numel / N elements: this rank's slice of the mean. async_op=True,
        tag f"bucket{b}"; return the handle, and keep the output for _complete."""
        raise NotImplementedError("_reduce")

    def _complete(self, b):
        """Bucket b's reduce-scatter has finished: write its result into this rank's slice of the
        bucket's gradient (self.buckets.buckets[b].grad[self.shards[b]]), which the step reads.
        (The rest of the buffer may keep this rank's own, unreduced gradients: nothing reads them.)"""
        raise NotImplementedError("_complete")

    def _publish(self):
        """The optimizer has updated this rank's slices (the views into the buckets' data). Give
        every rank every slice: for each bucket, all-gather the ranks' slices into its flat buffer
        (tag f"param{b}"). An all-gather's input must not be a view of its output: pass a copy."""
        raise NotImplementedError("_publish")
