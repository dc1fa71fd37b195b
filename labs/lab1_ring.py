"""Lab 1: the ring collectives, built from sends and receives (chapter 4).

Write the four functions below. The grader runs them on 3 ranks, on small tensors of whole
numbers (exact sums in any order), and gives each a RingLedger: a zerolab.runtime.comm.Ledger whose
isend(tensor, dst) and irecv(tensor, src) start a message and return a handle with .wait(), and
which counts the bytes and notes where every message goes. Stuck? The lab's notebook has hints,
folded: open one at a time.

    python -m zerolab.labs grade ring labs/lab1_ring.py

Ranks r = 0 .. N-1 sit in a ring: rank r's right neighbour is (r + 1) % N, its left (r - 1) % N.
"""

import torch


def exchange(ledger, send, recv, r, n):
    """Send the tensor `send` to the right neighbour and receive `recv` (in place) from the left
    one; return when both are done. Every rank calls it at the same moment, so it must not wait
    for anything its neighbours can only do after it returns.

    May use: ledger.isend(tensor, dst), ledger.irecv(tensor, src) (each returns a handle with
    .wait()), ledger.send and ledger.recv (the same, blocking)."""
    raise NotImplementedError("exchange")


def reduce_scatter_chunks(chunks, ledger, r, n):
    """The ring reduce-scatter, in place. `chunks` is this rank's tensor cut into N equal chunks
    (views: change them in place). Afterwards chunks[r] holds the sum over all ranks of chunk r;
    the other chunks may hold anything.

    N - 1 steps; in each, every rank sends one chunk to its right neighbour and receives one from
    its left, which it adds into its own copy of that chunk: each chunk travels round the ring
    collecting one contribution per hop and arrives complete at the rank that owns it.

    May use: exchange, torch.empty_like."""
    raise NotImplementedError("reduce_scatter_chunks")


def all_gather_chunks(chunks, ledger, r, n):
    """The ring all-gather, in place. Rank r starts with the true chunks[r] (the others hold
    anything); afterwards every rank holds every rank's chunk, each in its place.

    N - 1 steps; in each, every rank sends one chunk to its right neighbour and receives one from
    its left.

    May use: exchange."""
    raise NotImplementedError("all_gather_chunks")


def ring_all_reduce(tensor, ledger):
    """In place: tensor <- the sum over ranks of tensor, for ANY number of elements, as a ring
    reduce-scatter followed by a ring all-gather.

    May use: the functions above, dist.get_rank(), dist.get_world_size(), torch.tensor_split."""
    raise NotImplementedError("ring_all_reduce")
