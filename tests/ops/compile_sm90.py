"""Compile every Triton kernel of moe_dispatch.ops for sm_90 (H100/H200) without a GPU: the real
compiler path (TTIR -> TTGIR -> LLVM -> PTX -> cubin with the bundled ptxas), which the CPU
interpreter skips. Run as a script with TRITON_INTERPRET unset; prints one line per kernel variant
and exits 1 on the first failure (tests/ops/test_compile.py runs it)."""
from __future__ import annotations

import os
import sys
import traceback

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from moe_dispatch.ops.kernels import fingerprint as FK  # noqa: E402
from moe_dispatch.ops.kernels import permute as KP  # noqa: E402
from moe_dispatch.ops.kernels import quantize as KQ  # noqa: E402
from moe_dispatch.ops.kernels import row_map as KM  # noqa: E402
from moe_dispatch.ops.kernels import slot_rows as KS  # noqa: E402
from moe_dispatch.ops.kernels import unpermute as KU  # noqa: E402

POINTERS = {
    "map_ptr": "*u8", "probs_ptr": "*fp32", "tokens_ptr": "*bf16", "slots_ptr": "*i32", "stats_ptr": "*i64",
    "status_ptr": "*i32", "counts_ptr": "*i32", "chunk_max_ptr": "*i32", "out_ptr": "*bf16",
    "out_probs_ptr": "*fp32", "grad_ptr": "*bf16", "grad_probs_ptr": "*fp32", "grad_tokens_ptr": "*bf16",
    "grad_token_probs_ptr": "*fp32", "rows_ptr": "*bf16", "grad_rows_ptr": "*bf16", "partial_ptr": "*fp32",
    "x_ptr": "*bf16", "index_ptr": "*i64", "scales_ptr": "*fp32", "out_scales_ptr": "*fp32", "q_ptr": "*u8",
    "covered_ptr": "*i8", "weights_ptr": "*i32", "table_ptr": "*i64",
}
WIDE = {"given_hash": "i64", "numel": "i64", "stride0": "i64", "stride1": "i64", "stride2": "i64"}
E4M3, E5M2 = 448.0, 57344.0  # the float8 formats' largest values: the kernels' OUT_FP8_MAX / FP8_MAX


def variants():
    """(kernel, constexprs, pointer overrides) covering each constexpr branch."""
    common = dict(CHUNK_T=256, BLOCK_E=64, PROBS_WORD=1, SIZES_WORD=0)
    yield KM._chunk_counts_kernel, dict(CHUNK_T=256, BLOCK_T=64, BLOCK_E=64, CHECK_PROBS=True, PROBS_WORD=1), {}
    for snap, check in ((False, False), (True, True)):
        yield KM._slots_kernel, dict(common, BLOCK_T=64, BLOCK_C=32, SNAPSHOT=snap, CHECK_SIZES=check), {}
    for has_probs in (True, False):
        yield KP._permute_kernel, dict(HAS_PROBS=has_probs, HAS_SCALES=False, BLOCK_H=1024, TOKEN_MAJOR=False,
                                      BLOCK_K=8, STORE_CM=".cs", NAN_BITS=0), {}
        yield KP._permute_bwd_kernel, dict(HAS_PROBS=has_probs, BLOCK_H=1024, TOKEN_MAJOR=True, SLOTS_PER_STEP=4,
                                          OUT_FP8_MAX=0.0), {}
    # float8 tokens move as bytes, with their scales; float8 results are written as bytes (_round_out).
    yield KP._permute_kernel, dict(HAS_PROBS=True, HAS_SCALES=True, BLOCK_H=1024, TOKEN_MAJOR=False, BLOCK_K=8,
                                  STORE_CM=".cs", NAN_BITS=0x7F), {"tokens_ptr": "*u8", "out_ptr": "*u8"}
    for fp8, ty in ((E4M3, "*fp8e4nv"), (E5M2, "*fp8e5")):
        yield KP._permute_bwd_kernel, dict(HAS_PROBS=True, BLOCK_H=1024, TOKEN_MAJOR=False, SLOTS_PER_STEP=4,
                                          OUT_FP8_MAX=fp8), {"grad_ptr": ty, "grad_tokens_ptr": "*u8"}
    for has_probs, fp64, fma in ((True, False, False), (True, False, True), (True, True, False), (False, False, False)):
        probs = {"probs_ptr": "*fp64", "partial_ptr": "*fp64", "grad_probs_ptr": "*fp64"} if fp64 else {}
        yield KU._unpermute_kernel, dict(HAS_PROBS=has_probs, HAS_SCALES=False, ACC_FP64=fp64, BLOCK_H=2048,
                                        TOKEN_MAJOR=False, BLOCK_E=64, PROBS_WORD=2, FMA=fma, SLOTS_PER_STEP=4,
                                        OUT_FP8_MAX=0.0), probs
        if fma:
            continue
        for per_token in (False, True):
            yield KU._unpermute_bwd_kernel, dict(HAS_PROBS=has_probs, HAS_SCALES=False, ACC_FP64=fp64, BLOCK_H=1024,
                                                TOKEN_MAJOR=False, SLOTS_PER_STEP=2, PER_TOKEN=per_token, BLOCK_J=8,
                                                BLOCK_E=64, OUT_FP8_MAX=0.0), probs
    # float8 rows with their scales: out in float8 (both formats), bf16 or fp32.
    for fp8, ty, out in ((E4M3, "*fp8e4nv", "*u8"), (E5M2, "*fp8e5", "*u8"), (0.0, "*fp8e4nv", "*fp32")):
        yield KU._unpermute_kernel, dict(HAS_PROBS=True, HAS_SCALES=True, ACC_FP64=False, BLOCK_H=2048,
                                        TOKEN_MAJOR=False, BLOCK_E=64, PROBS_WORD=2, FMA=False, SLOTS_PER_STEP=4,
                                        OUT_FP8_MAX=fp8), {"rows_ptr": ty, "out_ptr": out}
    for has_probs, per_token in ((True, False), (True, True), (False, False)):
        yield KU._unpermute_bwd_kernel, dict(HAS_PROBS=has_probs, HAS_SCALES=True, ACC_FP64=False, BLOCK_H=1024,
                                            TOKEN_MAJOR=False, SLOTS_PER_STEP=2, PER_TOKEN=per_token, BLOCK_J=8,
                                            BLOCK_E=64, OUT_FP8_MAX=E4M3),\
            {"grad_ptr": "*fp32", "rows_ptr": "*fp8e4nv", "grad_rows_ptr": "*u8"}
    yield KU._probs_grad_kernel, dict(BLOCK_J=8, BLOCK_E=64), {}
    yield KS._cover_rows_kernel, dict(BLOCK_T=64, BLOCK_J=8), {}
    for out in ("*bf16", "*u8", "*fp32"):  # zeros in the rows no slot points at: bf16, float8 bytes, fp32
        yield KS._zero_uncovered_rows_kernel, dict(BLOCK_R=64, BLOCK_W=256), {"out_ptr": out}
    yield KP._gather_rows_kernel, dict(BLOCK_H=1024, TOKEN_MAJOR=False), {}
    for fp8, x, one_pass, stages in ((E4M3, "*bf16", True, 1), (E5M2, "*fp32", False, 1), (E4M3, "*bf16", True, 3)):
        yield KQ._quantize_rows_kernel, dict(FP8_MAX=fp8, AMAX_FLOOR=2.0 ** -64, BLOCK_T=2, BLOCK_H=4096,
                                            ONE_PASS=one_pass, STAGES=stages), {"x_ptr": x}

    # the bits fingerprint: 1-, 2-, 4- and 8-byte elements, contiguous and strided
    for ty, words, bits in (("*u8", 1, 8), ("*i16", 1, 16), ("*i32", 2, 32), ("*i64", 4, 64)):
        for contiguous in (True, False):
            yield FK._fingerprint_kernel, dict(WORDS=words, ELEMENT_BITS=bits, CONTIGUOUS=contiguous,
                                               CHUNK_ELEMENTS=(1 << 15) // words, BLOCK=FK.BLOCK,
                                               PRIME=(1 << 31) - 1), {"x_ptr": ty, "partial_ptr": "*i64"}


def main() -> int:
    target = GPUTarget("cuda", 90, 32)
    for kernel, constexprs, overrides in variants():
        signature = {}
        for name in kernel.arg_names:
            if name in constexprs:
                signature[name] = "constexpr"
            elif name.endswith("_ptr"):
                signature[name] = overrides.get(name, POINTERS[name])
            else:
                signature[name] = WIDE.get(name, "i32")
        constexprs = {k: v for k, v in constexprs.items() if k in kernel.arg_names}
        what = f"{kernel.fn.__name__} {constexprs}"
        try:
            triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=target,
                           options={"enable_fp_fusion": False})
        except Exception:
            print(f"FAIL {what}", flush=True)
            traceback.print_exc()
            return 1
        print(f"ok   {what}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
