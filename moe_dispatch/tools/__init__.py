"""What a user runs: the ``moe-dispatch`` command (``cli``), its contract check (``check``, a package split by job,
and ``check_sizes``), the ops demo (``ops_demo``), CUDA-graph capture of a step (``capture``) and
profiling helpers (``profiling``)."""
