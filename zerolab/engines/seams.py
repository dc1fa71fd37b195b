"""The labs' protected API: the methods of the library's classes that a lab has a student write.

A lab's grader builds the library's own class with these methods left to write (zerolab.labs),
and the library's versions are the reference solutions. So they keep their names, arguments and
meaning from one release to the next, and they are the only underscored names the labs replace;
an engine's other underscored methods are its own and may change. The attributes a seam may use
are listed in each lab's class docstring (zerolab.labs.ddp.DDPLab, ...).

Each entry: the class (where it lives) -> {method: what it must do}.
"""

SEAMS = {
    "DDP": {            # zerolab.engines.ddp.DDP, lab 3 (chapter 5)
        "_take": "put p's fresh gradient in its slot of bucket b; p.grad becomes that slot",
        "_on_grad_ready": "autograd's hook: count the gradient in, launch every bucket that is full",
        "_reduce": "divide bucket b by N and start its all-reduce; return the handle",
        "_finish_backward": "launch what is left, wait for everything in flight",
    },
    "ZeRO1": {          # zerolab.engines.zero1.ZeRO1, lab 4 (chapter 6)
        "_lay_out_masters": "which slice of each bucket this rank owns, and its master",
        "_reduce": "reduce-scatter bucket b's gradient into this rank's slice; return the handle",
        "_complete": "write the result into the owned slice of the bucket's gradient",
        "_publish": "after the optimizer stepped the owned slices: every rank gets every slice",
    },
    "ZeRO2": {          # zerolab.engines.zero2.ZeRO2, lab 5 (chapter 7)
        "_take": "copy p's gradient into bucket b's communication buffer, free p.grad",
        "_reduce": "divide the buffer by N, reduce-scatter it into this rank's gradient slice",
        "_complete": "accumulate the result (in fp32: _acc32), give the buffer back to the pool",
    },
    "Unit": {           # zerolab.engines.zero3.units.Unit, lab 6 (chapter 8)
        "gather": "start the all-gather of the full buffer (nothing if done or under way)",
        "wait": "block until gathered; the parameters may be read from then on",
        "release": "free the full buffer; only this rank's shard is kept",
        "reduce_scatter": "start reducing the full gradient (divided by N) to this rank's shard",
        "finish_reduce": "wait for it, keep (or add to) the gradient shard, free the full gradient",
    },
    "UnitSchedule": {   # zerolab.engines.zero3.schedule.UnitSchedule (ZeRO3's), lab 6
        "_prefetch_after": "gather the unit that `order` needs after unit u (phase: forward, backward)",
    },
    "ParamViews": {     # zerolab.optim.param_views.ParamViews, lab 7 (chapter 6)
        "_cut": "cut one view per parameter of this rank's slice of a bucket",
        "place": "each optimizer group's parameters -> their views, in the group's order",
        "point_grads": "each view's .grad -> its range of the flat gradient (None where skipped)",
        "pieces": "what this rank sends of the optimizer state: its views' ranges, serialized",
        "assemble": "every rank's pieces -> each parameter's state whole, in its shape",
        "shard": "a whole-model state dict -> the slices this rank's views cover",
    },
}


def of(name: str) -> tuple:
    """The seams of class `name`, in the order a lab lists them."""
    return tuple(SEAMS[name])
