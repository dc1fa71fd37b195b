"""The zerolab command line.

    python -m zerolab train --world-size 2 --steps 100 [--strategy ddp] [--precision bf16]
    python -m zerolab bench [--quick]
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
    p_train = sub.add_parser("train", help="train the book's GPT and report what was measured")
    train.add_arguments(p_train)

    if importlib.util.find_spec("zerolab.bench"):
        sub.add_parser("bench", help="benchmark the engines side by side", add_help=False)

    if argv[:1] == ["bench"] and importlib.util.find_spec("zerolab.bench"):
        from . import bench  # the benchmark parses its own arguments
        return bench.main(argv[1:])

    args = parser.parse_args(argv)
    if args.command == "train":
        return train.main(args)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
