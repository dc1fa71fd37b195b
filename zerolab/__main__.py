"""The zerolab command line.

    python -m zerolab train --world-size 2 --steps 100 [--strategy ddp] [--precision bf16]
    python -m zerolab bench [--quick]
    python -m zerolab consolidate CHECKPOINT_DIR OUT.pt   # one fp32 state dict, no processes
    python -m zerolab doctor [DIR]                # where the ranks' collectives parted (zerolab.runtime.doctor)
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
    p_cons.add_argument("path", help="checkpoint directory (zerolab's metadata.json, or a torch.distributed.checkpoint's .metadata)")
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
        from .runtime.doctor import main as doctor_main
        return doctor_main(args.dir)
    parser.error(f"unknown command {args.command!r}")
    return 2


def consolidate_main(args) -> int:
    import torch

    from .checkpoint import CheckpointError, consolidate
    from .checkpoint.atomic import new_file

    def error(message, code=2) -> int:
        print(f"zerolab consolidate: error: {message}", file=sys.stderr)
        return code
    problem = _where_out_cannot_go(args.path, args.out)
    if problem:
        return error(problem)
    try:
        # OUT's temporary file is created first (exclusively: a link there is not followed), so
        # a place that cannot be written is named before the work; renamed into place at the end
        with new_file(args.out) as f:
            state = consolidate(args.path)
            torch.save(state, f)
    except CheckpointError as exc:
        return error(exc, 1)
    except OSError as exc:   # a full disk, a file system that refuses new files (/proc), no permission
        return error(f"cannot write {args.out!r}: {exc.strerror or exc}")
    n = sum(t.numel() for k, t in state.items() if t.is_floating_point())
    print(f"zerolab consolidate: {len(state)} tensors ({n:,} values, fp32) written to {args.out}")
    return 0


def _where_out_cannot_go(path: str, out: str) -> str:
    """Why `out` cannot receive the consolidated state dict of checkpoint `path` ("" if it can):
    a directory, a directory that does not exist, the checkpoint directory itself or a folder in
    it (a checkpoint holds its own files only), or one of its files under another name."""
    import os
    if os.path.isdir(out):
        return f"OUT {out!r} is a directory; give a file name such as model.pt"
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        return f"OUT {out!r}: the directory {parent!r} does not exist; create it first"
    if not os.path.isdir(path):
        return ""                    # (consolidate names a missing checkpoint itself)
    ckpt, where = os.path.realpath(path), os.path.realpath(parent)
    if where == ckpt or where.startswith(ckpt.rstrip(os.sep) + os.sep):
        return (f"OUT {out!r} is inside the checkpoint directory {path!r}; write it elsewhere (a "
                "checkpoint holds its own files only: OUT would replace one of them, or the next save "
                "would remove it)")
    if os.path.exists(out):
        mine = os.stat(out)
        for entry in os.scandir(path):
            if os.path.samestat(mine, entry.stat(follow_symlinks=False)):
                return f"OUT {out!r} is the checkpoint's own {entry.name} under another name; write it elsewhere"
    return ""


if __name__ == "__main__":
    sys.exit(main())
