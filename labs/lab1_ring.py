"""Lab 1: the ring collectives, built from sends and receives (chapter 4).

Write the four functions below. The grader runs them on 3 ranks, on small tensors of whole
numbers (exact sums in any order), and gives each a RingLedger: a zerolab.comm.Ledger whose
isend(tensor, dst) and irecv(tensor, src) start a message and return a handle with .wait(), and
which counts the bytes and notes where every message goes.

    python -m zerolab.labs grade ring labs/lab1_ring.py

Ranks r = 0 .. N-1 sit in a ring: rank r's right neighbour is (r + 1) % N, its left (r - 1) % N.
"""

import torch


def exchange(ledger, send, recv, r, n):
    """Send the tensor `send` to the right neighbour while receiving `recv` (in place) from the left
    one; return when both are done. Start both messages before waiting for either: a ring of ranks
    that each wait for their own send to finish before receiving may wait for each other forever."""
    raise NotImplementedError("exchange")


def reduce_scatter_chunks(chunks, ledger, r, n):
    """The ring reduce-scatter, in place. `chunks` is this rank's tensor cut into N equal chunks
    (views: change them in place). Afterwards chunks[r] holds the sum over all ranks of chunk r;
    the other chunks may hold anything.

    N - 1 steps; in each, every rank sends one chunk to its right neighbour (exchange) and adds the
    chunk it receives from its left neighbour into its own copy of that chunk. Choose which chunk to
    send at step s so that each chunk travels round the ring collecting one contribution per hop
    and arrives complete, after N - 1 hops, at the rank that owns it. Receive into scratch space,
    not into the chunk you add it to."""
    raise NotImplementedError("reduce_scatter_chunks")


def all_gather_chunks(chunks, ledger, r, n):
    """The ring all-gather, in place. Rank r starts with the true chunks[r] (the others hold
    anything); afterwards every rank holds every rank's chunk, each in its place.

    N - 1 steps; in each, every rank passes on to its right neighbour the chunk it has most recently
    completed (at first its own), receiving the next one from its left neighbour straight into its
    place."""
    raise NotImplementedError("all_gather_chunks")


def ring_all_reduce(tensor, ledger):
    """In place: tensor <- the sum over ranks of tensor, for ANY number of elements: a ring
    reduce-scatter followed by a ring all-gather, on the same N chunks. Find r and N with
    torch.distributed (dist.get_rank(), dist.get_world_size()); cut the flat tensor into N nearly
    equal chunks with torch.tensor_split (they are views)."""
    raise NotImplementedError("ring_all_reduce")
