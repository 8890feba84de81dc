"""Numerics that the contract rests on: fixed-order sums and row-stable matrix products
(``fixed_order``), the autograd rules every function of the package shares (``autograd``), and
the integer helpers every size check and padding uses (``rounding``)."""

__all__ = ["ordered_mm", "tree_sum"]


def __getattr__(name: str):
    # Lazily: fixed_order's torch.compiler.disable loads torch._dynamo (seconds), which the config
    # and size checks that import ``numerics.rounding`` must not pay.
    if name in __all__:
        from . import fixed_order

        return getattr(fixed_order, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
