"""`ExpertRows`: the local experts' input, in one frozen record.

A dispatch hands its experts rows [N, H], expert-major (local expert 0's rows, then expert 1's,
...), and with them how they split by expert: the rows per expert (on the device, and on the host
where the plan has them), their cumulative ends, whether rows trail after the last expert, and the
per-source blocks. These always travel together, so they travel as one record: the dispatcher
builds it (``moe_dispatch.dispatcher.to_expert_rows``), ``LocalExperts.forward`` and ``fp8_mlp``
take it. A plain call builds it with ``ExpertRows.of(x, rows_per_expert)``.

Names: ``rows_per_expert`` is the count of rows of each local expert (padding included) on the
rows' device; ``host_rows_per_expert`` the same counts on the CPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..ops.fp8_rows import Fp8Rows
from .gemm import SourceBlocks


@dataclass(frozen=True)
class ExpertRows:
    """The rows the local experts take, and how they split by expert. Immutable.

    Attributes:
        rows: [N, H] expert-major, in the tokens' dtype; FP8: ``Fp8Rows`` (float8 values [N, H],
            one fp32 scale per row, and the ``grad_sink`` [N, H] in the output dtype that their
            gradient goes to: float8 rows cannot carry one).
        rows_per_expert: int [E_local] on the rows' device, the rows of each local expert (padding
            included). None where only the host copy is at hand.
        host_rows_per_expert: CPU int [E_local], the same counts on the host. None where nobody read
            them (a sync-free dispatch: the read would cost a host synchronisation).
        offsets: int32 [E_local] on the rows' device, cumsum(rows_per_expert): the groups' row ends
            that grouped GEMMs take without a host-to-device copy. None: computed where needed.
        probs: [N], each row's routing probability, or None. The experts apply them only with
            ``probs_in_experts`` (otherwise the combine does).
        trailing_rows: the counts may sum to less than N; the rows after the last expert's block
            belong to no expert (a sync-free dispatch's buffer; see ``expert_gemm``).
        source_blocks: the (local expert, source EP rank) blocks, for per-source weight gradients
            (``LocalExperts.collect_source_grads``; ``gemm.SourceBlocks``): a dropless dispatch's host
            [E_local][P] (first row, rows) pairs, or a sync-free dispatch's device int tensor
            [E_local, P] on the rows' device, each block's rows, the blocks tiling the rows from
            row 0 and the trailing rows in none (never read on the host by the grouped GEMMs).
            None otherwise.

    At least one of ``rows_per_expert`` and ``host_rows_per_expert`` is given; the GEMMs take the
    host copy where it exists (``gemm_counts``).
    """

    rows: torch.Tensor | Fp8Rows
    rows_per_expert: Optional[torch.Tensor] = None
    host_rows_per_expert: Optional[torch.Tensor] = None
    offsets: Optional[torch.Tensor] = None
    probs: Optional[torch.Tensor] = None
    trailing_rows: bool = False
    source_blocks: Optional[SourceBlocks] = None

    def __post_init__(self) -> None:
        if not isinstance(self.rows, (torch.Tensor, Fp8Rows)):
            raise ValueError(f"ExpertRows.rows must be a tensor [N, H] or Fp8Rows, got {type(self.rows).__name__}")
        if self.rows_per_expert is None and self.host_rows_per_expert is None:
            raise ValueError("ExpertRows needs rows_per_expert (int [E_local] on the rows' device) or "
                             "host_rows_per_expert (its CPU copy), got neither")
        host = self.host_rows_per_expert
        if host is not None and (not isinstance(host, torch.Tensor) or host.device.type != "cpu"):
            where = host.device if isinstance(host, torch.Tensor) else type(host).__name__
            raise ValueError(f"ExpertRows.host_rows_per_expert must be a CPU tensor [E_local], got {where}")
        blocks = self.source_blocks
        if isinstance(blocks, torch.Tensor):
            if blocks.dim() != 2 or blocks.is_floating_point() or blocks.device != self.rows.device:
                raise ValueError(f"ExpertRows.source_blocks as a tensor must be integer [E_local, P] on the rows' "
                                 f"device {self.rows.device}, got {blocks.dtype} {list(blocks.shape)} on "
                                 f"{blocks.device}")
        elif blocks is not None and not isinstance(blocks, (tuple, list)):
            raise ValueError("ExpertRows.source_blocks must be host [E_local][P] (first row, rows) pairs or a device "
                             f"int tensor [E_local, P], got {type(blocks).__name__}")

    @property
    def gemm_counts(self) -> torch.Tensor:
        """The counts the expert GEMMs take: the host copy where it exists (the loop GEMMs then read
        nothing from the device), else the device tensor (read only by a GEMM path that needs it)."""
        return self.host_rows_per_expert if self.host_rows_per_expert is not None else self.rows_per_expert

    @classmethod
    def of(cls, rows: torch.Tensor | Fp8Rows, rows_per_expert: torch.Tensor, probs: Optional[torch.Tensor] = None,
           offsets: Optional[torch.Tensor] = None) -> "ExpertRows":
        """A plain call's record: rows [N, H] (or Fp8Rows), rows_per_expert int [E_local] (a CPU tensor is taken
        as the host copy, one elsewhere as the device tensor), probs [N] or None, offsets as above."""
        if not isinstance(rows_per_expert, torch.Tensor):
            raise ValueError(f"rows_per_expert must be an int tensor [E_local], got {type(rows_per_expert).__name__}")
        if rows_per_expert.device.type == "cpu":
            return cls(rows, host_rows_per_expert=rows_per_expert, offsets=offsets, probs=probs)
        return cls(rows, rows_per_expert=rows_per_expert, offsets=offsets, probs=probs)
