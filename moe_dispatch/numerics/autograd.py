"""The one check every backward of this package makes: no double backward.

Our backward formulas (autograd.Function and the torch.library ops' registered autograd) are
written for first-order gradients only; they call ops that have no backward of their own. The
autograd engine runs a backward with grad mode on exactly when it builds a graph of it
(``create_graph=True``), so that is where each formula raises, naming itself, instead of failing
somewhere inside autograd.
"""
from __future__ import annotations

import torch


def refuse_double_backward(name: str) -> None:
    """Call first in a backward formula: raises RuntimeError under create_graph=True."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"moe_dispatch: double backward (create_graph=True) through {name} is not supported: "
                           f"differentiate the layer once (create_graph=False)")
