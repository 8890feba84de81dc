"""`moe-dispatch check`: prove the contract on this machine.

Builds a small MoE layer on N ranks, runs forward + backward and checks, bitwise, that a token's
output, input gradient and router weight gradient are the same:
  every rank     on every rank that holds the same tokens;
  dispatcher     with the allgather and the alltoall dispatcher;
  EP size        at every expert-parallel size;
  batch          when the other tokens of the batch change: tokens 90 onwards zeroed (the first 90
                 must not change), and one token run alone against the same token in the batch.
It then compares our output with the float64 sum of the same expert outputs (within one final
rounding), and prints reference rows that are not ours and are expected to differ: the same expert
outputs combined as a reduce-scatter combine does (each EP rank rounds its partial sum to the
activation dtype before the ranks' partials are added), at EP 1 and at larger EP sizes. Last, the
layouts rows: a small model with an MoELayer trained for 3 steps with GradientTree on N
micro-batches per step, at (world N, EP N) and on half the ranks with two micro-batches each,
against (world N, EP 1): parameters, gradients, losses and clipped norms bitwise (N a power of two).
Exits nonzero on any FAIL of our rows; reference rows (DIFF) never fail the check. With --megatron,
megatron-core's MoELayer is checked too: with its stock dispatcher (reference rows, PASS or DIFF)
and with ours installed (rows that count).

Launch plainly (it spawns the ranks itself: 4 CPU ranks on gloo by default, one rank per GPU on
NCCL where CUDA is present) or under torchrun, which sets the ranks:

    moe-dispatch check
    python -m moe_dispatch.tools.check --ranks 2 --dtype fp32
    torchrun --nproc-per-node 8 -m moe_dispatch.tools.check --ep-sizes 1,2,4,8
"""
# The check by job (this docstring is the command's --help):
#   args       the flags: the parser, and every flag checked before any rank starts
#   contract   the contract's rows (every rank, dispatcher, EP size, batch; CUDA-graph replay),
#              the Result row and the comparisons
#   reference  ours against the float64 sum (in ulps), and the reduce-scatter reference rows
#   layouts    a short training run with GradientTree, bitwise across layouts with the same L
#   report     the table, its legends, the throughput line and the verdict
#   launch     main: checks the flags (no torch imported yet), then spawns the ranks or runs under torchrun
#   ranks      each rank's main_worker: builds the layer, runs the rows, gathers the results
from .launch import main

__all__ = ["main"]
