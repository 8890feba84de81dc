"""Numerics that the contract rests on: fixed-order sums and row-stable matrix products
(``fixed_order``), and the autograd rules every function of the package shares (``autograd``)."""
