"""The flags of `moe-dispatch check`: the parser, and every flag checked before any rank starts.

A bad flag is one ``parser.error`` (exit status 2) naming it, printed once under torchrun.

This module imports no torch (nor anything that does) when it loads: ``validate_flags`` checks what
the flags alone decide in a fraction of a second; ``validate_with_torch`` imports torch (seconds) for the
checks that need it: the backend and world size, the memory of this machine, MoEConfig.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import torch

    from ...config import MoEConfig

# The --dtype names and their torch dtypes' names; DTYPES (name -> torch dtype) loads torch on first use.
_TORCH_DTYPE_NAMES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}
DTYPE_NAMES = tuple(_TORCH_DTYPE_NAMES)
# config.DISPATCHER_KINDS, written out so that the parser loads without torch (tests/tools/test_cli.py
# checks that the two agree).
DISPATCHER_KINDS = ("allgather", "alltoall")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a --dtype name (imports torch)."""
    import torch

    return getattr(torch, _TORCH_DTYPE_NAMES[name])


def __getattr__(name: str) -> Any:
    if name == "DTYPES":  # ``from .args import DTYPES`` in the rank code, which has torch loaded anyway
        value = globals()[name] = {n: torch_dtype(n) for n in DTYPE_NAMES}
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors print once under torchrun: every rank parses and exits 2,
    only rank 0 says why."""

    def error(self, message: str):  # type: ignore[override]
        if os.environ.get("RANK", "0") != "0" and "WORLD_SIZE" in os.environ:
            self.exit(2)
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    # The help's description is the command's own page: the package docstring.
    parser = _Parser(prog="moe-dispatch check", description=sys.modules[__package__].__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=None,
                        help="ranks to spawn when not under torchrun (default: GPUs if any, else 4)")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                        help="default: nccl with CUDA, else gloo")
    parser.add_argument("--ep-sizes", default=None,
                        help="comma-separated EP sizes to compare (default: powers of two up to --ranks)")
    parser.add_argument("--dispatcher", choices=["both", *DISPATCHER_KINDS], default="both")
    parser.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default="bf16", help="activation dtype")
    parser.add_argument("--router-dtype", choices=["fp32", "fp64"], default="fp32")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per rank (at least 2)")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--ffn", type=int, default=128)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--truncate-at", type=int, default=90,
                        help="tokens kept in the truncation test, below --tokens (default 90, or half of "
                             "--tokens when that is 90 or fewer)")
    parser.add_argument("--megatron", action="store_true",
                        help="also run the checks on megatron-core's own MoELayer (SequentialMLP, no TE), beside "
                             "ours on the same tokens: with its stock dispatcher (reference rows: PASS or DIFF, "
                             "never a FAIL) and with our dispatcher installed (counted like ours); needs "
                             "megatron-core (0.16.1 through 0.19.2) and CUDA")
    parser.add_argument("--fp8", nargs="?", const="e4m3", default=None, choices=["e4m3"],
                        help="the layer in FP8 (MoEConfig(fp8=...)): per-token fp8 rows and scales over the wire, "
                             "FP8 expert GEMMs; --fp8 alone is e4m3; needs --dtype bf16")
    parser.add_argument("--no-fp8-wgrad", action="store_true",
                        help="with --fp8: the expert weight gradients in the tokens' dtype "
                             "(MoEConfig(fp8_wgrad=False), Megatron's --no-fp8-wgrad)")
    parser.add_argument("--seed", type=int, default=1234)
    return parser


def base_config(args: argparse.Namespace, **overrides) -> MoEConfig:
    """The MoEConfig the check's flags describe (``overrides``: further fields, such as the dispatcher)."""
    from ...config import MoEConfig

    return MoEConfig(hidden_size=args.hidden, num_experts=args.experts, topk=args.topk, ffn_hidden_size=args.ffn,
                     router_dtype=args.router_dtype, init_seed=args.seed, fp8=args.fp8,
                     fp8_wgrad=not args.no_fp8_wgrad, **overrides)


def default_backend(args: argparse.Namespace) -> str:
    """--backend, else nccl with CUDA and gloo without."""
    import torch

    return args.backend or ("nccl" if torch.cuda.is_available() else "gloo")


def spawn_world(args: argparse.Namespace, backend: str) -> int:
    """Ranks to spawn when not under torchrun: --ranks, else one per GPU on nccl and 4 on gloo."""
    import torch

    return args.ranks or (torch.cuda.device_count() if backend == "nccl" else 4)


def under_torchrun() -> bool:
    """Whether torchrun (or a launcher like it) set the ranks."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


# The check's flags by the MoEConfig field they set: a config error names the flag.
_FLAG_OF_FIELD = {"hidden_size": "--hidden", "ffn_hidden_size": "--ffn", "num_experts": "--experts",
                  "topk": "--topk", "router_dtype": "--router-dtype", "init_seed": "--seed",
                  "dispatcher": "--dispatcher", "fp8_wgrad": "--no-fp8-wgrad", "fp8": "--fp8"}


def _config_error_as_flags(message: str) -> str:
    """A MoEConfig error with its field names written as the check's flags, led by the first one."""
    fields = re.compile(r"\b(" + "|".join(_FLAG_OF_FIELD) + r")\b")
    first = fields.search(message)
    text = fields.sub(lambda m: _FLAG_OF_FIELD[m.group(1)], message)
    if not first:
        return f"invalid flags: {text}"
    flag = _FLAG_OF_FIELD[first.group(1)]
    return f"argument {flag}: {text[len(flag) + 1:] if text.startswith(flag + ' ') else text}"


def validate_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Optional[list[str]]) -> None:
    """The checks the flags alone decide, without torch: a bad flag is refused in a fraction of a
    second, not after the seconds torch takes to import. One ``parser.error`` (exit status 2)."""
    fail = parser.error
    if args.ranks is not None and args.ranks < 1:
        fail(f"argument --ranks: must be >= 1, got {args.ranks}")
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if args.ranks is not None and args.ranks != world:
            fail(f"argument --ranks: {args.ranks} differs from torchrun's WORLD_SIZE={world}; leave --ranks out")
    # The truncation test zeroes tokens keep.. and compares tokens 0..keep-1, and one token alone
    # against the first: it needs a token on each side of the cut.
    if args.tokens < 2:
        fail(f"argument --tokens: must be >= 2 (the truncation test keeps some tokens and zeroes the rest), "
             f"got {args.tokens}")
    if args.truncate_at < 1:
        fail(f"argument --truncate-at: must be >= 1 (tokens kept and compared), got {args.truncate_at}")
    given = parser.parse_args(argv, argparse.Namespace(truncate_at=None)).truncate_at is not None
    if given and args.truncate_at >= args.tokens:
        fail(f"argument --truncate-at: {args.truncate_at} must be below --tokens {args.tokens}, "
             "or the truncation test zeroes nothing")
    if args.fp8 is not None and args.dtype != "bf16":  # the FP8 GEMMs' outputs are bf16 on CUDA
        fail(f"argument --fp8: needs --dtype bf16, got --dtype {args.dtype}")
    if args.no_fp8_wgrad and args.fp8 is None:
        fail("argument --no-fp8-wgrad: needs --fp8 (it sets where the FP8 layer's weight gradients run)")
    if args.topk == 1:  # MoEConfig would ask for pre_softmax, which the check has no flag for
        fail("argument --topk: must be >= 2 (the check's softmax router over one chosen expert gets no gradient)")
    if args.ep_sizes is not None:
        sizes = _ep_sizes(args.ep_sizes)
        if sizes is None:
            fail(f"argument --ep-sizes: expected comma-separated ints such as 1,2,4, got {args.ep_sizes!r}")
        if len(set(sizes)) < len(sizes):
            fail(f"argument --ep-sizes: {args.ep_sizes!r} lists a size twice (it would compare a run with itself)")


def _ep_sizes(text: str) -> Optional[list[int]]:
    """--ep-sizes as ints, or None if it is not a comma-separated list of ints."""
    try:
        return [int(s) for s in text.split(",")]
    except ValueError:
        return None


def validate_with_torch(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """The checks that import torch, after ``validate_flags``: the backend, the world size, this
    machine's memory, MoEConfig; returns the world size. Like ``validate_flags``, before any
    process or process group starts: a bad flag is one ``parser.error`` (exit status 2) naming the
    flag, never a traceback per rank; a check that would compare nothing is refused the same way."""
    import torch

    from ..check_sizes import SIZE_FLAGS, memory_per_rank, size_problem

    fail = parser.error
    backend = default_backend(args)
    if backend == "nccl" and not torch.cuda.is_available():
        fail("argument --backend: nccl needs CUDA, which is not available here (use --backend gloo)")
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
    else:
        world = spawn_world(args, backend)
        if backend == "nccl" and world > torch.cuda.device_count():
            fail(f"argument --ranks: {world} ranks on nccl need {world} GPUs, this machine has "
                 f"{torch.cuda.device_count()} (use --backend gloo for more ranks than GPUs)")
    defaults = {name: parser.get_default(name) for name in SIZE_FLAGS}
    itemsize = torch_dtype(args.dtype).itemsize
    if problem := size_problem(args, defaults, world, itemsize, memory_per_rank(backend, world)):
        fail(problem)  # before any rank starts: not an allocator error in each rank's traceback
    try:
        base = base_config(args)
        for kind in DISPATCHER_KINDS if args.dispatcher == "both" else (args.dispatcher,):
            base.replace(dispatcher=kind)
    except ValueError as exc:
        fail(_config_error_as_flags(str(exc)))
    if args.experts % world:
        fail(f"argument --experts: {args.experts} experts do not split over the {world} ranks "
             f"(the throughput line runs at EP {world})")
    for s in _ep_sizes(args.ep_sizes) if args.ep_sizes is not None else []:
        if s < 1 or world % s:  # a divisor of the world divides --experts too (checked above)
            fail(f"argument --ep-sizes: {s} does not divide the {world} ranks")
    return world
