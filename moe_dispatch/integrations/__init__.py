"""Integrations with other frameworks: ``megatron`` (our dispatchers inside megatron-core's MoELayer),
``megatron_cpu`` (test-only shims that run megatron-core's MoELayer on CPU / gloo), ``megatron_build``
(megatron-core's MoELayer with explicit process groups and seeded weights, outside Megatron's
training set-up) and ``megatron_check`` (``moe-dispatch check --megatron``)."""
