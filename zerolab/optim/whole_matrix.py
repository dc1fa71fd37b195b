"""Optimizers that see whole matrices (Muon, Adafactor) on engines that cut parameters.

Muon orthogonalizes each matrix's momentum (a Newton-Schulz iteration over the whole matrix);
Adafactor keeps a row and a column statistic per matrix and scales each step by the matrix's
norm. Neither can step the piece of a matrix that a flat shard's edge leaves on one rank: it
would compute something else. ZeRO's flat layout (optim.param_views) already hands the
optimizer most parameters whole: a parameter that lies inside one rank's slice is a view in its
own shape. Only the parameters that a shard's EDGE cuts (at most N-1 per flat buffer) are in
pieces. Those are the ones this module handles, the design Megatron calls gathering the
boundary matrices:

* each cut parameter gets an OWNER, the rank that holds the largest piece of it (the lowest
  such rank on a tie), and the optimizer of the owner steps it whole: it is handed a whole fp32
  tensor in the parameter's shape (its storage allocated for the step only), and keeps the
  parameter's optimizer state whole (Muon's momentum, Adafactor's factored statistics). The
  other ranks that hold a piece hand their optimizer an empty tensor, which is never stepped;
* before the optimizer's update (`gather`), one all-to-all moves every piece's fp32 gradient
  and value to its owner, which puts the parameter together;
* after the update (`give_back`), a second all-to-all returns each piece's new value to the
  rank that holds it, which writes it into its master slice. The engine's usual all-gather
  (ZeRO-1 and 2) or the next forward's gather (ZeRO-3) then spreads it as always.

An all-to-all with equal blocks: X is the largest number of elements that one rank holds of the
parameters owned by one other rank. The first moves 2X fp32 values per block (gradient and
value), the second X, so each rank sends, by the ring accounting of zerolab.runtime.comm,

    (N-1)/N * N * 2X * 4  +  (N-1)/N * N * X * 4  =  12 (N-1) X   bytes per step

on top of the engine's own collectives. X is at most the largest cut parameter; for a model
whose matrices are small beside a shard it is a small fraction of one matrix.

Every parameter the optimizer steps parameter by parameter (AdamW beside Muon, in a
zl.CombinedOptimizer) keeps its pieces, as before. Which parameters need to be whole is read
from the class of the optimizer (or member of a CombinedOptimizer) whose group holds them
(`whole_ids`).
"""

from __future__ import annotations

import torch

# Optimizers whose update of an element depends on the rest of its tensor (Adafactor's factored
# moments and relative step size, Muon's orthogonalized matrices, LAMB's and LARS's per-tensor trust
# ratio), torch's and by family name: a script may bring its own Muon (Keller Jordan's, nanochat's),
# Shampoo, SOAP or LAMB.
WHOLE_TENSOR_OPTIMIZERS = tuple(getattr(torch.optim, n) for n in ("Adafactor", "Muon") if hasattr(torch.optim, n))
WHOLE_TENSOR_FAMILIES = ("muon", "adafactor", "shampoo", "soap", "dion", "kfac", "lamb", "lars")


def needs_whole(kind) -> bool:
    """Does an optimizer of class `kind` update an element from the rest of its tensor?"""
    if not isinstance(kind, type):
        return False
    if issubclass(kind, WHOLE_TENSOR_OPTIMIZERS):
        return True
    return any(family in kind.__name__.lower() for family in WHOLE_TENSOR_FAMILIES)


def whole_ids(optimizer, moved=None) -> set:
    """ids of the parameters (the script's, before they were moved onto views) that `optimizer`
    must step whole: those in the groups of a whole-matrix optimizer class, or of such a member
    of a zl.CombinedOptimizer."""
    members = getattr(optimizer, "optimizers", None) or [optimizer]
    out = set()
    for member in members:
        if needs_whole(type(member)):
            for group in member.param_groups:
                out |= {id(moved.get(id(t), t) if moved else t) for t in group["params"]}
    return out


class Cut:
    """A parameter a shard's edge cuts: its master `i`, its place [o, o + k) in the bucket, the
    rank that steps it whole, and each holder's piece (bucket coordinates)."""

    def __init__(self, p, i, o, k, pieces: dict):
        self.p, self.i, self.o, self.k, self.pieces = p, i, o, k, pieces
        self.owner = max(sorted(pieces), key=lambda r: pieces[r][1] - pieces[r][0])
        self.whole = None           # on the owner: the tensor its optimizer steps


def cuts_of(buckets, slices, ids) -> tuple:
    """(cuts, N, this rank) of the parameters in `ids` that a shard's edge cuts. slices[i] is this
    rank's slice of bucket i; every rank's slice has that length (zerolab.buckets)."""
    out, n, me = [], 1, 0
    for i, (bucket, s) in enumerate(zip(buckets, slices)):
        size = s.stop - s.start
        n, me = bucket.padded_numel // size, s.start // size
        for j, (p, o, k) in enumerate(zip(bucket.params, bucket.offsets, bucket.sizes)):
            first, last = o // size, (o + k - 1) // size
            if id(p) in ids and first != last:
                pieces = {r: (pc.start, pc.stop) for r in range(first, last + 1)
                          for pc in [bucket.piece(j, slice(r * size, (r + 1) * size))]}
                out.append(Cut(p, i, o, k, pieces))
    return out, n, me


def attach(views, ids) -> "WholeMatrices | None":
    """Hand the owner of each cut parameter in `ids` a whole tensor, and every other holder an
    empty one, in `views` (an optim.param_views.ParamViews, before its tensors go into the
    optimizer's groups). None when no such parameter is cut (one rank; or every matrix inside
    one slice): the views are then whole already."""
    if not ids:
        return None
    cuts, n, me = cuts_of(views.buckets, views.slices, ids)
    if not cuts:
        return None
    return WholeMatrices(views, cuts, n, me)


class WholeMatrices:
    """The cut parameters of one engine (or zl.ShardedOptimizer) and their two exchanges."""

    def __init__(self, views, cuts, n, me):
        self.views, self.cuts, self.n, self.me = views, cuts, n, me
        self.values = {}            # id(p) -> (master index, lo, hi): this rank's piece, for checkpoints
        for c in cuts:
            if me not in c.pieces:
                continue
            lo, hi = (x - views.slices[c.i].start for x in c.pieces[me])
            self.values[id(c.p)] = (c.i, lo, hi)
            master = views.masters[c.i]
            if me == c.owner:       # whole, its storage allocated for the step only
                c.whole = torch.empty(c.p.shape, dtype=master.dtype, device=master.device)
                c.whole.untyped_storage().resize_(0)
                views.view_of[id(c.p)], views.piece[id(c.p)] = c.whole, (0, c.k)
            else:                   # stepped by its owner: nothing to step here
                views.view_of[id(c.p)], views.piece[id(c.p)] = \
                    master.detach()[:0].view((0,) + tuple(c.p.shape[1:])), (0, 0)
            views.where[id(c.p)] = (c.i, 0, 0)      # (its gradient arrives by `gather`)
        views.replanned()                           # (point_grads reads the new views)
        # each block of the all-to-alls: what one rank sends one other rank
        self.block = max([sum(self._length(c, h) for c in self._between(h, o))
                          for h in range(n) for o in range(n) if h != o] or [0])

    # ------------------------------------------------------------------ the layout
    def _between(self, holder, owner) -> list:
        """The cuts `owner` steps of which `holder` holds a piece, in one order on every rank."""
        return [c for c in self.cuts if c.owner == owner and holder in c.pieces and holder != owner]

    @staticmethod
    def _length(c, r) -> int:
        lo, hi = c.pieces[r]
        return hi - lo

    def _mine(self, c, flat):
        """This rank's piece of cut c in a tensor with its master's layout."""
        i, lo, hi = self.values[id(c.p)]
        return flat[lo:hi]

    def segments(self, names) -> list:
        """Checkpoint segments (master, lo, name, lo, hi) of this rank's pieces of the cut
        parameters: their values live in the masters, whoever steps them."""
        out = []
        for c in self.cuts:
            if id(c.p) in self.values:
                i, lo, hi = self.values[id(c.p)]
                out.append((self.views.masters[i], lo, names[id(c.p)], *(x - c.o for x in c.pieces[self.me])))
        return out

    # ------------------------------------------------------------------ the two exchanges
    @torch.no_grad()
    def gather(self, ledger, group=None, skip=()) -> None:
        """Before the update: every piece's gradient and value to its owner, which steps the
        parameter whole (a parameter in `skip`, reached by no rank's backward, keeps no
        gradient: the optimizer skips it, as in one process). Every rank calls it."""
        masters, L = self.views.masters, self.block
        device = masters[0].device
        send = torch.zeros(self.n, 2 * L, dtype=torch.float32, device=device)
        for owner in range(self.n):
            at = 0
            for c in self._between(self.me, owner):
                piece = self._mine(c, masters[c.i].grad)
                send[owner, at:at + piece.numel()] = piece
                send[owner, L + at:L + at + piece.numel()] = self._mine(c, masters[c.i].detach())
                at += piece.numel()
        got = torch.empty_like(send)
        ledger.all_to_all(got.view(-1), send.view(-1), group=group, tag="whole:gather")
        at = [0] * self.n
        for c in self.cuts:
            if c.owner != self.me:
                continue
            c.whole.untyped_storage().resize_(c.k * c.whole.element_size())
            value, grad = c.whole.view(-1), torch.empty(c.k, dtype=c.whole.dtype, device=device)
            for r, (lo, hi) in c.pieces.items():
                where = slice(lo - c.o, hi - c.o)
                if r == self.me:
                    value[where] = self._mine(c, masters[c.i].detach())
                    grad[where] = self._mine(c, masters[c.i].grad)
                else:
                    grad[where] = got[r, at[r]:at[r] + hi - lo]
                    value[where] = got[r, L + at[r]:L + at[r] + hi - lo]
                    at[r] += hi - lo
            c.whole.grad = None if id(c.p) in skip else grad.view(c.p.shape)

    @torch.no_grad()
    def give_back(self, ledger, group=None) -> None:
        """After the update: each piece's new value from its owner to the rank that holds it,
        into its master slice; the owners' whole tensors are freed. Every rank calls it."""
        masters, L = self.views.masters, self.block
        device = masters[0].device
        send = torch.zeros(self.n, L, dtype=torch.float32, device=device)
        for holder in range(self.n):
            at = 0
            for c in self._between(holder, self.me):
                lo, hi = c.pieces[holder]
                send[holder, at:at + hi - lo] = c.whole.view(-1)[lo - c.o:hi - c.o]
                at += hi - lo
        got = torch.empty_like(send)
        ledger.all_to_all(got.view(-1), send.view(-1), group=group, tag="whole:return")
        at = [0] * self.n
        for c in self.cuts:
            if id(c.p) not in self.values:
                continue
            mine = self._mine(c, masters[c.i].detach())
            if c.owner == self.me:
                lo, hi = c.pieces[self.me]
                mine.copy_(c.whole.view(-1)[lo - c.o:hi - c.o])
                c.whole.grad = None
                c.whole.untyped_storage().resize_(0)
            else:
                mine.copy_(got[c.owner, at[c.owner]:at[c.owner] + mine.numel()])
                at[c.owner] += mine.numel()

    def bytes_per_step(self) -> int:
        """What the two all-to-alls send per step from each rank (zerolab.runtime.comm's accounting)."""
        return 12 * (self.n - 1) * self.block
