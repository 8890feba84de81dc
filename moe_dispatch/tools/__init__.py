"""What a user runs: the ``moe-dispatch`` command (``cli``), its contract check (``check``, a package split by job,
and ``check_sizes``), the ops demo (``ops_demo``), CUDA-graph capture of a step (``capture``),
profiling helpers (``profiling``), and what the benchmark scripts and the tests share: the benchmarks'
inputs and copy bandwidth (``benchmarks``), the batch-invariance probe of an activation
(``batch_invariance``), and GradientTree's six-layout training run (``gradient_tree_layouts``)."""
