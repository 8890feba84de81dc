"""Integrations with other frameworks: ``megatron`` (our dispatchers inside megatron-core's MoELayer,
0.16.1 through 0.19.2), ``megatron_build`` (megatron-core's MoELayer with explicit process groups and
seeded weights, outside Megatron's training set-up) and ``megatron_check`` (``moe-dispatch check
--megatron``). The CPU shims that let megatron-core run on CPU ranks are test-only
(tests/megatron_cpu.py): they patch torch.cuda process-wide."""
