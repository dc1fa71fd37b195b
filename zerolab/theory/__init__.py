"""What the papers and the chapters reason with, as code: closed forms and small simulations that
the measurements are set beside. No engine imports them.

    numerics      floating-point formats bit by bit: spacing, rounding, the lost small update (chapter 1)
    calculator    the memory calculator: what fits, per stage, with activations (chapters 3, 10)
    cost_model    how long collectives and training steps take on a cluster (chapters 4, 5, 8, 10, 12)
    allocator     a small caching allocator, to see fragmentation and defragmentation (chapter 9)
    collectives   ring reduce-scatter, all-gather and all-reduce from point-to-point sends (chapter 4)
"""
