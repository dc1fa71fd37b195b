"""The zerolab command line.

    python -m zerolab train --world-size 2 --steps 100 [--strategy ddp] [--precision bf16]
    python -m zerolab bench [--quick]
    python -m zerolab consolidate CHECKPOINT_DIR OUT.pt   # one fp32 state dict, no processes
    python -m zerolab doctor [DIR]                # where the ranks' collectives parted (zerolab.doctor)
    torchrun --nproc-per-node 2 -m zerolab train ...
"""

from __future__ import annotations

import argparse
import importlib.util
import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m zerolab",
                                     description="ZeRO from first principles, measured.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    from . import train
    p_train = sub.add_parser("train", help="train the book's GPT and report what was measured",
                             formatter_class=train.HelpWithDefaults)
    train.add_arguments(p_train)

    p_cons = sub.add_parser("consolidate", help="turn a sharded checkpoint into one fp32 state dict")
    p_cons.add_argument("path", help="checkpoint directory (holds metadata.json)")
    p_cons.add_argument("out", help="where to write the state dict (torch.save; load it with "
                        "torch.load(out, weights_only=True))")

    p_doc = sub.add_parser("doctor", help="read a run's collective flight records: where the ranks parted")
    p_doc.add_argument("dir", nargs="?", help="the run's records (named in the error; default: the newest run)")

    if importlib.util.find_spec("zerolab.bench"):
        sub.add_parser("bench", help="benchmark the engines side by side", add_help=False)

    if argv[:1] == ["bench"] and importlib.util.find_spec("zerolab.bench"):
        from . import bench  # the benchmark parses its own arguments

        def plot(summary, directory):   # --plot: the book's figures (the library never imports the book)
            from .book.bench_plots import plot_bench
            return plot_bench(summary, directory)
        return bench.main(argv[1:], plot=plot)

    args = parser.parse_args(argv)
    if args.command == "train":
        return train.main(args)
    if args.command == "consolidate":
        return consolidate_main(args)
    if args.command == "doctor":
        from .doctor import main as doctor_main
        return doctor_main(args.dir)
    parser.error(f"unknown command {args.command!r}")
    return 2


def consolidate_main(args) -> int:
    import os

    import torch

    from .checkpoint import CheckpointError, consolidate
    if os.path.isdir(args.out):
        print(f"zerolab consolidate: error: OUT {args.out!r} is a directory; give a file name "
              "such as model.pt", file=sys.stderr)
        return 2
    try:
        state = consolidate(args.path)
    except CheckpointError as exc:
        print(f"zerolab consolidate: error: {exc}", file=sys.stderr)
        return 1
    tmp = f"{args.out}.tmp-{os.getpid()}"
    try:
        torch.save(state, tmp)
        os.replace(tmp, args.out)
    except BaseException:   # a full disk, a missing directory, Ctrl-C: no half-written file is left
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    n = sum(t.numel() for k, t in state.items() if t.is_floating_point())
    print(f"zerolab consolidate: {len(state)} tensors ({n:,} values, fp32) written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
