"""Labs: write the part of an engine a chapter teaches, and have zerolab grade it on real ranks.

Each lab (labs/*.ipynb in the book) comes with a file of stubs: the methods of one of zerolab's own
engines that the chapter explains (the seams chapters 4 to 8 print; lab 7, what chapter 6 says the
optimizer is handed), each raising NotImplementedError. You fill them in; the grader plugs your code into the library in place of its
own, runs it on 2 or 3 gloo ranks on a tiny model, and checks, in order:

    it runs       no crash and no hang (a hang is named by rank and operation within seconds)
    protocol      what the chapter says must happen when (a bucket reduced only when full, ...)
    parity        the gradients and weights of ONE process trained on the global batch
    bytes         the ledger's bytes per step against the closed form (ring counts, 2 Psi, 3 Psi)
    memory        what a rank holds against the chapter's formula
    overlap       compute ran while the collectives were in flight (zerolab.labs.overlap: counted
                  in events, not seconds)
    (lab 7)       the optimizer's views and their gradients against a closed form of the layout,
                  its state and state_dict() against a plain AdamW's, a plain checkpoint loaded

and explains the FIRST failure in the chapter's words: the rank, the bucket or unit, the step,
what was expected and what was seen, the method and line of the graded file it comes from, and the
section to re-read.

    python -m zerolab.labs list
    python -m zerolab.labs grade ddp labs/lab3_ddp.py
    python -m zerolab.labs grade ddp --reference        # the library's own code: the solution
    python -m zerolab.labs grade ddp --bitwise          # the library's engine with bitwise=True is
                                                        # one process bit for bit (zerolab.labs.exact)

    from zerolab.labs import grade
    grade("ddp", "lab3_ddp.py")                          # in a notebook

The library's own code passes every lab (the grader grades zerolab too), and each lab keeps the
mistakes students make, planted in the library's code (zerolab/labs/*_mistakes.py); the tests
check that each one fails with its own message.
"""

from .lab import LABS
from .runner import Report, grade, grade_cases, grade_many

__all__ = ["LABS", "Report", "grade", "grade_cases", "grade_many"]
