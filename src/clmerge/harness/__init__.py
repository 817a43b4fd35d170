"""Experiment harnesses that sit above the kernels: the merging benchmark (``clmerge merge-bench``).

* :mod:`.merge_bench`: one benchmark run (experts, grid search on validation, test table);
* :mod:`.merge_bench_data`, :mod:`.merge_bench_experts`: tasks and experts (the head protocols);
* :mod:`.merge_bench_grid`: grid search that extends each grid until the chosen value is interior;
* :mod:`.merge_bench_run`: the benchmark as ``clmerge merge-bench`` runs it (checked arguments, one or more seeds);
* :mod:`.merge_bench_seeds`: several fine-tuning seeds, mean ± standard error;
* :mod:`.merge_bench_analysis`: CART's rank-ratio curve, spectra and interference.

Layer: above the engine and the library; below theory and sweep (docs/architecture.md).
"""
