"""The book's own code: the demos each chapter runs and the figures it draws.

Nothing here is part of the library a student trains with (zerolab's engines, comm, memory,
precision, checkpoint ...): these modules call that library the way a reader would, measure,
and plot. One module per idea of a chapter:

    fp_plots, mixed_precision_demo   chapters 1 and 2: floating point, mixed precision
    reduction_dtype, scaler_rules    chapters 1 and 2: the dtype a collective adds in; three loss scalers
    memory_demo, memory_plots, plots   chapter 3: where the memory goes (plots: shared bar charts)
    dp_demo, timeline, cost_plots    chapters 4 and 5: collectives, data parallelism, the cost model's figures
    collective_plots, ddp_plots, bucket_model   chapters 4 and 5: what moves where; buckets against backward
    bitwise_demo, bitwise_plots      chapter 5: the bits that change with N, the fixed tree that keeps them, its cost
    bitwise_engines                  chapter 5: every engine in both modes against one process
    cost_checks, cost_check_plots    the appendix: the cost model against published measurements
    zero_demo, zero_plots            chapters 6 and 7: ZeRO-1 and ZeRO-2
    zero3_demo, zero3_plots, zero3_trace, zero3_cost   chapter 8: ZeRO-3, its traces, and when its traffic hides
    zero_r_demo, zero_r_plots        chapter 9: ZeRO-R
    scaling_demo, bench_plots        chapter 10: scaling up, the benchmark's figures
    paper_tables, stage_choice       chapter 10: the paper's printed tables; choosing a stage
    own_model_demo, own_model_failures   chapter 11: a Hugging Face model, and what breaks
    own_model_habits, own_model_figures  chapter 11: the habits table and the chapter's figures
    zeropp_demo                      chapter 12: ZeRO++ and HSDP, bytes by link class, schematics
    offload_demo, offload_plots      chapter 13: offload to host memory and to disk, measured
    per_parameter_demo, per_parameter_plots   chapter 14: FSDP2's per-parameter sharding, whole-matrix optimizers
    museum, museum_reference, museum_plots    chapter 15: users' failures reproduced, diagnosed, fixed
    web_widgets                      chapters 1, 3, 10: calculators that work in the page, no kernel
    gpu_results, gpu_results_ch11_13  chapters 2, 5, 8-13: what was measured on a GPU (gpu/results/)
    mfu                              the GPU tables' model FLOPs per token (no embedding lookups)
    source                           chapters 2, 6, 7, 8: library source printed beside the prose
"""

import importlib


def __getattr__(name):
    # zl.book.plots and friends load on first use, as zerolab's own modules do
    try:
        module = importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = module
    return module
