"""Lab 1: the ring reduce-scatter, all-gather and all-reduce, from sends and receives (chapter 4).

The student writes four functions, the ones zerolab.theory.collectives builds its ring collectives from:

    exchange(ledger, send, recv, r, n)          send `send` to the right neighbour while receiving
                                                `recv` from the left one
    reduce_scatter_chunks(chunks, ledger, r, n) in place: afterwards chunks[r] is the sum over ranks
    all_gather_chunks(chunks, ledger, r, n)     in place: every chunk arrives at every rank
    ring_all_reduce(tensor, ledger)             the sum over ranks in place: the two above, in turn

They run on 3 ranks (with 2, left and right are the same rank and many wrong indices come out
right) on small tensors of whole numbers, whose sums are exact in any order. The ledger they are
given is a RingLedger: it counts the bytes, and notes for each message its peer, so the grader can
check that every message goes round the ring.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..theory import collectives       # the library's ring: the reference
from ..runtime.comm import Ledger
from .checks import fmt_bytes
from .lab import Check, Lab, Wrong

C = 3                             # elements per chunk
SECTION = 'chapter 4, "The ring algorithm, step by step"'


@dataclass
class RingLedger(Ledger):
    """The ledger your functions are given: a zerolab.runtime.comm.Ledger (isend, irecv -> handles with
    .wait()) that also notes every message: (phase, "send" | "recv", peer, elements)."""

    log: list = field(default_factory=list)
    phase: str = ""

    def isend(self, tensor, dst, group=None, tag=""):
        self.log.append((self.phase, "send", dst, tensor.numel()))
        return super().isend(tensor, dst, group, tag)

    def irecv(self, tensor, src, group=None, tag=""):
        self.log.append((self.phase, "recv", src, tensor.numel()))
        return super().irecv(tensor, src, group, tag)

    def send(self, tensor, dst, group=None, tag=""):
        self.log.append((self.phase, "send", dst, tensor.numel()))
        return super().send(tensor, dst, group, tag)

    def recv(self, tensor, src, group=None, tag=""):
        self.log.append((self.phase, "recv", src, tensor.numel()))
        return super().recv(tensor, src, group, tag)


# the solution: the library's own ring (zerolab.theory.collectives), under the lab's names
def library_exchange(ledger, send, recv, r, n):
    collectives.exchange(ledger, send, recv, r, n, tag="ring")


def library_reduce_scatter_chunks(chunks, ledger, r, n):
    collectives.reduce_scatter_chunks(chunks, ledger, r, n, tag="ring")


def library_all_gather_chunks(chunks, ledger, r, n):
    collectives.all_gather_chunks(chunks, ledger, r, n, tag="ring")


def library_ring_all_reduce(tensor, ledger):
    collectives.ring_all_reduce(tensor, ledger)


ROLES = ("exchange", "reduce_scatter_chunks", "all_gather_chunks", "ring_all_reduce")
REFERENCE = dict(zip(ROLES, (library_exchange, library_reduce_scatter_chunks, library_all_gather_chunks,
                             library_ring_all_reduce)))


# ------------------------------------------------------------------ the inputs: whole numbers


def rs_input(r: int, n: int) -> torch.Tensor:
    """Rank r's tensor for the reduce-scatter: element j of chunk c is 100 r + 10 c + j + 1."""
    return torch.tensor([100.0 * r + 10 * c + j + 1 for c in range(n) for j in range(C)])


def true_chunk(c: int) -> list:
    """Chunk c of the all-gather, as the rank that owns it starts with it."""
    return [1000.0 + 10 * c + j for j in range(C)]


def ar_input(r: int, numel: int) -> torch.Tensor:
    return torch.tensor([7.0 * r + i + 1 for i in range(numel)])


# ------------------------------------------------------------------ one graded run, on every rank


def measure(plugin) -> dict:
    r, n = dist.get_rank(), dist.get_world_size()
    ledger = RingLedger()
    out = {"rank": r, "n": n}

    ledger.phase = "exchange"
    recv = torch.zeros(2)
    plugin["exchange"](ledger, torch.full((2,), 10.0 * r + 1), recv, r, n)
    out["exchange"] = recv.tolist()

    ledger.phase = "reduce_scatter"
    x = rs_input(r, n)
    plugin["reduce_scatter_chunks"](list(x.split(C)), ledger, r, n)
    out["reduce_scatter"] = x.tolist()

    ledger.phase = "all_gather"
    y = torch.full((n * C,), -1.0)
    y[r * C:(r + 1) * C] = torch.tensor(true_chunk(r))
    plugin["all_gather_chunks"](list(y.split(C)), ledger, r, n)
    out["all_gather"] = y.tolist()

    for phase, numel in (("all_reduce", n * C), ("all_reduce_uneven", n * C + 1)):
        ledger.phase = phase
        z = ar_input(r, numel)
        plugin["ring_all_reduce"](z, ledger)
        out[phase] = z.tolist()
    out["log"] = ledger.log
    return out


# ------------------------------------------------------------------ the checks, in the parent


def _count(k: int, what: str) -> str:
    return f"{k} {what}{'s' * (k != 1)}"


def _chunk(values, c):
    return values[c * C:(c + 1) * C]


def exchange(ranks) -> str:
    n = len(ranks)
    for d in ranks:
        r = d["rank"]
        left, right = (r - 1) % n, (r + 1) % n
        if d["exchange"] == [10.0 * left + 1] * 2:
            continue
        if d["exchange"] == [10.0 * right + 1] * 2:
            raise Wrong("reversed", f"rank {r} received rank {right}'s tensor, its RIGHT neighbour's: the ring "
                        "runs the wrong way.", "send to (r + 1) % N, receive from (r - 1) % N.")
        if d["exchange"] == [0.0] * 2:
            raise Wrong("recv_untouched", f"rank {r}'s `recv` still holds the zeros it was given; its left "
                        f"neighbour, rank {left}, sent {[10.0 * left + 1] * 2}: the message arrived somewhere else.",
                        "receive into `recv` itself (ledger.irecv(recv, src)): the caller reads that tensor, and "
                        "a tensor made inside exchange is lost when it returns.")
        raise Wrong("exchange_wrong", f"rank {r} received {d['exchange']}; its left neighbour, rank {left}, "
                    f"sent {[10.0 * left + 1] * 2}.", "post the send and the receive, then wait for both.")
    return "every rank received its left neighbour's tensor while sending to its right one"


def reduce_scatter(ranks) -> str:
    n = len(ranks)
    inputs = [rs_input(q, n).tolist() for q in range(n)]
    sums = [[sum(_chunk(inputs[q], c)[j] for q in range(n)) for j in range(C)] for c in range(n)]
    for d in ranks:
        r, seen = d["rank"], d["reduce_scatter"]
        mine = _chunk(seen, r)
        if mine == sums[r]:
            continue
        where = f"rank {r}'s chunk {r} holds {mine}; the sum over ranks of chunk {r} is {sums[r]}"
        steps = sum(1 for ph, kind, *_ in d["log"] if ph == "reduce_scatter" and kind == "send")
        if steps != n - 1:
            raise Wrong("step_count", f"{where}: rank {r} made {_count(steps, 'ring step')}; on {n} ranks a "
                        f"reduce-scatter takes N - 1 = {n - 1}.",
                        "each chunk must pass N - 1 ranks to collect every rank's contribution.")
        elsewhere = [c for c in range(n) if c != r and _chunk(seen, c) in sums]
        if elsewhere:
            raise Wrong("wrong_chunk", f"{where}; a finished sum landed in rank {r}'s chunk {elsewhere[0]} "
                        "instead: the chunk indices are off.",
                        "at step s rank r sends chunk (r - s - 1) mod N and receives (and adds) chunk "
                        "(r - s - 2) mod N: chunk c starts at rank c + 1 and ends at rank c.")
        if mine == _chunk(inputs[r], r):
            raise Wrong("nothing_added", f"{where}: its own values, untouched.",
                        "each step, add the chunk received from the left into your own copy of it.")
        for q in range(n):
            if q != r and any(mine == _chunk(inputs[q], c) for c in range(n)):
                raise Wrong("copied_not_added", f"{where}: one of rank {q}'s chunks, copied over yours: a "
                            "received chunk must be ADDED to yours.", "chunks[recv_i].add_(incoming).")
            if [s - v for s, v in zip(sums[r], _chunk(inputs[q], r))] == mine:
                raise Wrong("missing_contribution", f"{where}: rank {q}'s contribution is missing.",
                            "a ring reduce-scatter takes N - 1 steps: each chunk passes N - 1 ranks.")
        raise Wrong("reduce_scatter_wrong", f"{where}.", "follow one chunk round the ring on paper, step by step.")
    return f"on {n} ranks, rank r ends with the sum of chunk r, exactly"


def all_gather(ranks) -> str:
    n = len(ranks)
    for d in ranks:
        r, seen = d["rank"], d["all_gather"]
        for c in range(n):
            others = [k for k in range(n) if k != c and _chunk(seen, c) == true_chunk(k)]
            if others:
                raise Wrong("wrong_place", f"rank {r}'s chunk {c} holds chunk {others[0]}: a chunk was "
                            "received into the wrong place.",
                            "at step s rank r passes on chunk (r - s) mod N and receives chunk (r - s - 1) mod N.")
        for c in range(n):
            got = _chunk(seen, c)
            if got == [-1.0] * C:
                steps = sum(1 for ph, kind, *_ in d["log"] if ph == "all_gather" and kind == "send")
                raise Wrong("never_arrived", f"rank {r}'s chunk {c} never arrived (it still holds the -1 it "
                            f"started with); rank {r} made {_count(steps, 'ring step')}, and on {n} ranks an "
                            f"all-gather takes N - 1 = {n - 1}.",
                            "N - 1 steps, each passing on the chunk received last.")
            off = got[0] - true_chunk(c)[0]
            if off < 0 and off == int(off) and all(g - t == off for g, t in zip(got, true_chunk(c))):
                raise Wrong("gathered_by_adding", f"rank {r}'s chunk {c} holds {got}: chunk {c}, {true_chunk(c)}, "
                            f"{-off:g} lower, one for each rank it passed, where each added the chunk it received "
                            "to the -1 the grader had left in the slot.",
                            "an all-gather copies: receive straight into the chunk (what is there is never "
                            "needed), with no scratch tensor and no addition.")
            if got != true_chunk(c):
                raise Wrong("all_gather_wrong", f"rank {r}'s chunk {c} holds {got}, not {true_chunk(c)}.",
                            "an all-gather copies chunks; it never adds.")
    return "every rank ends with every chunk"


def all_reduce(ranks) -> str:
    n = len(ranks)
    for phase, numel in (("all_reduce", n * C), ("all_reduce_uneven", n * C + 1)):
        total = [sum(ar_input(q, numel)[i].item() for q in range(n)) for i in range(numel)]
        for d in ranks:
            r, seen = d["rank"], d[phase]
            if seen == total:
                continue
            bounds = torch.tensor_split(torch.arange(numel), n)
            right = [bool(all(seen[i] == total[i] for i in b.tolist())) for b in bounds]
            bad = next(i for i in range(numel) if seen[i] != total[i])
            first = f"element {bad} holds {seen[bad]:g}, the sum over ranks is {total[bad]:g}"
            if all(abs(s * n - t) <= 1e-5 * abs(t) for s, t in zip(seen, total)):
                raise Wrong("divided", f"rank {r}'s tensor of {numel} elements holds the sum divided by N = {n}, "
                            f"the mean ({first}).", "a ring all-reduce here is the SUM over ranks: the engines "
                            "divide their gradients by N before they call it, not inside it.")
            if right[r] and sum(right) == 1:
                raise Wrong("no_all_gather", f"rank {r}'s tensor of {numel} elements is the sum in its own "
                            f"chunk only ({first}): the all-gather half is missing.",
                            "an all-reduce is a reduce-scatter AND an all-gather, on the same chunks.")
            if phase == "all_reduce_uneven":
                sizes = [len(b) for b in bounds]
                raise Wrong("uneven", f"with {numel} elements on {n} ranks (not a multiple of N) rank {r} "
                            f"does not end with the sum ({first}); torch.tensor_split cuts {numel} elements into "
                            f"{n} chunks of {', '.join(map(str, sizes))}.",
                            "cut any size into exactly N chunks with torch.tensor_split: a split into chunks of "
                            "numel // N elements makes N + 1 chunks when N does not divide the size, and the ring "
                            "never visits the last.")
            raise Wrong("all_reduce_wrong", f"rank {r} does not end with the sum over ranks "
                        f"({numel} elements: {first}).", "reduce-scatter, then all-gather, on the same chunks.")
    return f"every rank ends with the sum, for {n * C} and for {n * C + 1} elements"


def bytes_and_ring(ranks) -> str:
    n = len(ranks)
    S = n * C * 4
    for d in ranks:
        r, log = d["rank"], d["log"]
        for phase, factor, formula in (("reduce_scatter", (n - 1) / n, "(N-1)/N S"),
                                       ("all_gather", (n - 1) / n, "(N-1)/N S"),
                                       ("all_reduce", 2 * (n - 1) / n, "2(N-1)/N S")):
            sends = [(peer, numel) for ph, kind, peer, numel in log if ph == phase and kind == "send"]
            recvs = [(peer, numel) for ph, kind, peer, numel in log if ph == phase and kind == "recv"]
            sent = 4 * sum(numel for _, numel in sends)
            seam = ("reduce_scatter_chunks", "all_gather_chunks", "ring_all_reduce")[
                ("reduce_scatter", "all_gather", "all_reduce").index(phase)]
            if sent != round(factor * S):
                raise Wrong("bytes", f"{phase.replace('_', '-')} of S = {S} B on {n} ranks: rank {r} sent "
                            f"{fmt_bytes(sent)} in {_count(len(sends), 'message')}; the ring sends {formula} = "
                            f"{fmt_bytes(factor * S)}, one chunk of S/N per step.",
                            "each step sends ONE chunk to the right neighbour, never the whole tensor.",
                            blame=(seam,))
            odd = [p for p, _ in sends if p != (r + 1) % n] + [p for p, _ in recvs if p != (r - 1) % n]
            if odd:
                raise Wrong("not_a_ring", f"{phase.replace('_', '-')}: rank {r} exchanged messages with rank "
                            f"{odd[0]}, which is not its neighbour in the ring.",
                            "send only to (r + 1) % N and receive only from (r - 1) % N.", blame=("exchange", seam))
    return (f"S = {S} B on {n} ranks: reduce-scatter and all-gather send (N-1)/N S = "
            f"{fmt_bytes((n - 1) / n * S)}, all-reduce 2(N-1)/N S = {fmt_bytes(2 * (n - 1) / n * S)}, every "
            "message to the right neighbour")


LAB = Lab(
    name="ring", number=1, title="ring collectives from sends and receives", chapter="chapter 4, Collectives",
    stub_file="lab1_ring.py", world_size=3,
    roles=dict.fromkeys(ROLES), reference=REFERENCE, measure=measure,
    checks=(Check("exchange: send right, receive left", exchange, SECTION),
            Check("reduce-scatter: rank r ends with the sum of chunk r", reduce_scatter, SECTION),
            Check("all-gather: every rank ends with every chunk", all_gather, SECTION),
            Check("all-reduce = reduce-scatter + all-gather", all_reduce,
                  'chapter 4, "Why all-reduce = reduce-scatter + all-gather"'),
            Check("bytes: (N-1)/N S per phase, to the right neighbour only", bytes_and_ring,
                  'chapter 4, "Bytes on the wire: measured against the formula"')),
    mistakes_module="zerolab.labs.ring_mistakes",
    blame={**dict.fromkeys(("reversed", "recv_untouched", "exchange_wrong"), ("exchange",)),
           **dict.fromkeys(("step_count", "wrong_chunk", "nothing_added", "copied_not_added", "missing_contribution",
                            "reduce_scatter_wrong"), ("reduce_scatter_chunks",)),
           **dict.fromkeys(("wrong_place", "never_arrived", "gathered_by_adding", "all_gather_wrong"),
                           ("all_gather_chunks",)),
           **dict.fromkeys(("divided", "no_all_gather", "uneven", "all_reduce_wrong"), ("ring_all_reduce",))},
)
