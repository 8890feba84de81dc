"""Integrations with other frameworks: ``megatron`` (our dispatchers inside megatron-core's MoELayer)
and ``megatron_cpu`` (test-only shims that run megatron-core's MoELayer on CPU / gloo)."""
