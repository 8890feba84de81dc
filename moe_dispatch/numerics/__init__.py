"""Numerics that the contract rests on: fixed-order sums and row-stable matrix products
(``fixed_order``), the autograd rules every function of the package shares (``autograd``), and
the integer helpers every size check and padding uses (``rounding``)."""

from .fixed_order import ordered_mm, tree_sum

__all__ = ["ordered_mm", "tree_sum"]
