"""Integrations with other frameworks: ``megatron`` (our dispatchers inside megatron-core's MoELayer,
0.16.1 through 0.19.2, and everything else that knows Megatron). The CPU shims that let
megatron-core run on CPU ranks are test-only (tests/megatron_cpu.py): they patch torch.cuda
process-wide."""
