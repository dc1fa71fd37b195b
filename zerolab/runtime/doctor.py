"""Where the ranks' sequences of collectives parted, and `python -m zerolab doctor DIR`.

`parting` compares ranks' flight records (zerolab.runtime.recorder) place by place in a process group's
sequence; zerolab.runtime.watchdog puts its verdict in the error of a collective that failed, timed out or
did not match. Every rank of a run writes its last collectives to DIR/rank<r>.rec (DIR is named in
that error); the doctor reads them all, after the run or while it hangs, and prints each rank's
state and last collectives, then, per process group, the first collective at which the ranks'
sequences parted:

    collective #12: rank 0 all_gather 'param0' (train.py:41), rank 1 reduce_scatter 'bucket0' (train.py:37)

DIR may also be the directory that holds the runs ($ZEROLAB_RECORD_DIR, by default
~/.cache/zerolab/records): the newest run is read.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

from .recorder import STATES, RankRecord, read_run, record_root

LAST = 4        # collectives shown per rank

# ------------------------------------------------------------------ where the ranks' sequences part


@dataclass
class Parting:
    """One place of a group's sequence and what each rank that reached it recorded there."""

    seq: int
    group: str
    at: dict            # {rank: Entry} at that place (ranks that reached it)
    by_line: bool       # the same collectives, called from different lines of the script

    def __str__(self) -> str:
        ranks: dict = {}                # ranks at the same collective are named together
        for r, e in sorted(self.at.items()):
            ranks.setdefault(e.where(), []).append(str(r))
        group = "" if self.group == "0" else f" of process group {self.group}"
        return f"collective #{self.seq}{group}: " + ", ".join(
            f"{'rank' if len(rs) == 1 else 'ranks'} {', '.join(rs)} {where}" for where, rs in ranks.items())


def parting(records: dict, group: str = "0") -> tuple:
    """(first place where the ranks' collectives differ, first place before it where the same
    collectives were called from different lines), each a Parting or None. Places only some
    ranks reached are compared among those: a rank that stopped early has not parted."""
    seqs = {r: rec.in_group(group) for r, rec in records.items()}
    places = sorted(set().union(*(s.keys() for s in seqs.values()))) if seqs else []
    by_line = None
    for seq in places:
        at = {r: s[seq] for r, s in seqs.items() if seq in s}
        if len(at) < 2:
            continue
        first = next(iter(at.values()))
        if any(not first.same_call(e) for e in at.values()):
            return Parting(seq, group, at, False), by_line
        if by_line is None and len({e.site for e in at.values()}) > 1:
            by_line = Parting(seq, group, at, True)
    return None, by_line


def describe_parting(records: dict, group: str = "0") -> str:
    """A sentence on where the ranks' sequences parted ("" when they did not)."""
    hard, soft = parting(records, group)
    if hard is None:
        return ""
    text = f"The ranks' sequences parted at {hard}."
    if soft is not None and soft.seq < hard.seq:
        text += f" Before that, the same collectives came from different lines of the script at {soft}."
    return text


# ------------------------------------------------------------------ the doctor


def find_run(path: str) -> str:
    """The run directory `path` names: itself, or the newest run inside it."""
    if any(n.endswith(".rec") for n in os.listdir(path)):
        return path
    runs = sorted(n for n in os.listdir(path) if n.startswith("run-") and os.path.isdir(os.path.join(path, n)))
    if not runs:
        raise FileNotFoundError(f"{path} holds no flight records (rank<r>.rec) and no run-* directory")
    return os.path.join(path, runs[-1])


def _rank_lines(rec: RankRecord) -> list:
    state = STATES.get(rec.state, f"state {rec.state}")
    alive = rec.process()
    head = (f"rank {rec.rank} of {rec.world} (pid {rec.pid} on {rec.host}): {rec.count} collectives, "
            f"{state}{f'; {alive}' if alive else ''}")
    lines = [head]
    for e in rec.entries[-LAST:]:
        when = time.strftime("%H:%M:%S", time.localtime(e.start))
        group = "" if e.group == "0" else f" [group {e.group}, #{e.seq}]"
        lines.append(f"    #{e.index} {e.where()}{group}: {e.dtype} {e.shape or 'scalar'}, {e.nbytes:,} bytes "
                     f"sent, at {when}{'' if e.done else ', not completed'}")
    return lines


def report(run_dir: str) -> list:
    """The doctor's lines for one run."""
    records = read_run(run_dir)
    if not records:
        return [f"{run_dir}: no flight records"]
    lines = [f"run {os.path.basename(run_dir)}: {len(records)} rank(s) recorded"]
    for r in sorted(records):
        lines += _rank_lines(records[r])
    groups = sorted({e.group for rec in records.values() for e in rec.entries if e.seq})
    for g in groups:
        members = {r: rec for r, rec in records.items() if any(e.group == g for e in rec.entries)}
        said = describe_parting(members, g)
        name = "" if g == "0" else f" (process group {g})"
        if said:
            lines.append(said)
        else:
            _, by_line = parting(members, g)
            ends = []
            for r, rec in sorted(members.items()):
                last = rec.in_group(g)[max(rec.in_group(g))]
                ends.append(f"rank {r} at #{last.seq} {last.where()}{'' if last.done else ', not completed'}")
            lines.append(f"The ranks' collectives{name} agree wherever more than one rank recorded them; "
                         f"the records end: {'; '.join(ends)}. (Only collectives through zerolab's ledger are "
                         "recorded: a torch.distributed call of the script's own is not.)")
            if by_line is not None:
                lines.append(f"The same collectives came from different lines of the script at {by_line}.")
    missing = sorted(set(range(max(rec.world for rec in records.values()))) - set(records))
    if missing:
        lines.append(f"No record of rank(s) {missing} here: they ran on another machine (their records are "
                     "there) or never reached a collective.")
    return lines


def main(path: str | None = None) -> int:
    path = path or record_root()
    try:
        run_dir = find_run(path)
    except (OSError, TypeError) as exc:
        print(f"zerolab doctor: error: {exc}", file=sys.stderr)
        return 2
    named = [n for n in os.listdir(run_dir) if n.startswith("rank") and n.endswith(".rec")]
    if named and not read_run(run_dir):
        print(f"zerolab doctor: error: {run_dir}: {len(named)} file(s) named rank*.rec, none of them a flight "
              "record zerolab wrote (another program's file, or one cut short)", file=sys.stderr)
        return 1
    print("\n".join(report(run_dir)))
    return 0
