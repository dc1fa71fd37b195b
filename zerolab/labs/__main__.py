"""python -m zerolab.labs list | grade NAME [PATH] [--reference | --mistake NAME | --bitwise]"""

from __future__ import annotations

import argparse
import os
import sys

from .lab import LABS
from .plugins import FileProblem, check_path
from .runner import grade
from .worker import load_lab


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zerolab.labs",
                                     description="Grade a lab: your code, run on real ranks against the book.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the labs, their stub files and planted mistakes")
    g = sub.add_parser("grade", help="grade a lab")
    g.add_argument("name", choices=list(LABS))
    g.add_argument("path", nargs="?", help="your file (default: the lab's stub file, here or in labs/)")
    which = g.add_mutually_exclusive_group()
    which.add_argument("--reference", action="store_true", help="grade the library's own code (the solution)")
    which.add_argument("--mistake", metavar="NAME", help="grade one of the lab's planted mistakes")
    which.add_argument("--bitwise", action="store_true", help="the library's engine with bitwise=True against "
                       "one process, torch.equal: the parity check's tolerance is round-off alone (labs 3 to 5)")
    args = parser.parse_args(argv)
    if args.command == "list":
        for name in LABS:
            lab = load_lab(name)
            print(f"{name:<7} lab {lab.number}: {lab.title} ({lab.chapter}); stubs labs/{lab.stub_file}; "
                  f"{len(lab.mistakes)} planted mistakes: {', '.join(m.name for m in lab.mistakes)}")
        return 0
    lab = load_lab(args.name)
    if args.bitwise:
        try:
            report = grade(args.name, bitwise=True)
        except ValueError as exc:       # a lab without an exact path: one line, no rank started
            print(f"python -m zerolab.labs grade {args.name} --bitwise: {exc}", file=sys.stderr)
            return 2
    elif args.reference or args.mistake:
        report = grade(args.name, reference=args.reference, mistake=args.mistake)
    else:
        path = args.path or next((p for p in (lab.stub_file, os.path.join("labs", lab.stub_file))
                                  if os.path.isfile(p)), None)
        if path is None:
            parser.error(f"no {lab.stub_file} here or in labs/: give the path of your file")
        try:
            check_path(lab, path)
        except FileProblem as exc:      # one line, before any rank starts
            print(f"python -m zerolab.labs grade {args.name}: {exc}", file=sys.stderr)
            return 2
        report = grade(args.name, path)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
