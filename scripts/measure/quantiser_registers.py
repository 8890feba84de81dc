"""Registers a thread of the quantisation kernels for sm_90 (H100 / H200), without a GPU.

Run:  python scripts/measure/quantiser_registers.py

Compiles ``quantize_rows``' and ``quantize_group_columns``' kernels through Triton's real compiler
path for sm_90 at several launch settings, runs the ptxas bundled with Triton (``-v``) on each PTX,
and prints one table: registers a thread, bytes spilled, shared memory, and the programs that fit
on one SM by registers and threads (65536 registers, 2048 threads and 32 programs a SM). A
memory-bound kernel wants many programs a SM (loads in flight); a program that holds a whole row
in registers gets one or two. quantize_group_columns' tiled route (three kernels) is listed by
its two kernels that read x. The launch
settings change no value (tests/ops/test_fp8.py, tests/ops/test_quantize_columns.py).
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moe_dispatch.ops.kernels import quantize as K

E4M3 = 448.0
REGISTERS_PER_SM, THREADS_PER_SM, PROGRAMS_PER_SM = 65536, 2048, 32
POINTERS = {"x_ptr": "*bf16", "q_ptr": "*u8", "scales_ptr": "*fp32", "row_scales_ptr": "*fp32", "starts_ptr": "*i64",
            "pstarts_ptr": "*i64", "partial_ptr": "*fp32", "qt_ptr": "*u8", "tile_ends_ptr": "*i64", "inv_ptr": "*fp32"}


def ptxas() -> str:
    from triton.backends.nvidia import compiler

    return str(Path(compiler.__file__).parent / "bin" / "ptxas")


def usage(kernel, constexprs: dict, warps: int, x_type: str = "*bf16") -> tuple[int, int, int]:
    """(registers a thread, spill-store bytes, shared bytes) of kernel compiled for sm_90."""
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = x_type if name == "x_ptr" else POINTERS[name]
        else:
            signature[name] = "i32"
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False, "num_warps": warps})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    report = subprocess.run([ptxas(), "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True,
                            text=True).stderr
    os.unlink(f.name)
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spilled = re.search(r"(\d+) bytes spill stores", report)
    return registers, int(spilled.group(1)) if spilled else 0, compiled.metadata.shared


def programs_per_sm(registers: int, warps: int) -> int:
    threads = 32 * warps
    return min(REGISTERS_PER_SM // (registers * threads), THREADS_PER_SM // threads, PROGRAMS_PER_SM)


def main() -> None:
    print("| kernel | setting | warps | elements a thread | registers a thread | spill bytes | shared bytes "
          "| programs a SM |\n|---|---|---|---|---|---|---|---|")
    rows = dict(FP8_MAX=E4M3, AMAX_FLOOR=2.0 ** -64, STAGES=1)
    for block_t, block_h, warps in ((2, 4096, 8), (1, 4096, 4), (1, 4096, 8), (1, 4096, 16), (1, 2048, 4),
                                    (1, 2048, 8), (1, 1024, 4), (1, 512, 4)):
        one_pass = block_h >= 4096
        r, s, sh = usage(K._quantize_rows_kernel, dict(rows, BLOCK_T=block_t, BLOCK_H=block_h, ONE_PASS=one_pass),
                         warps)
        setting = f"{block_t} x {block_h} ({'one pass' if one_pass else 'two passes'}, H 4096)"
        print(f"| quantize_rows | {setting} | {warps} | {block_t * block_h // (32 * warps)} | {r} | {s} | {sh} | "
              f"{programs_per_sm(r, warps)} |", flush=True)
    for block_c, block_r, warps in ((64, 128, 4), (64, 64, 4), (32, 64, 4), (32, 64, 8), (32, 32, 4), (64, 16, 4),
                                    (64, 32, 8), (128, 64, 4)):
        for x_type, has_scales in (("*bf16", False), ("*fp8e4nv", True)):
            constexprs = dict(FP8_MAX=E4M3, AMAX_FLOOR=2.0 ** -64, BLOCK_R=block_r, BLOCK_C=block_c, SPLITS=1,
                              HAS_SCALES=has_scales, X_FP8_MAX=E4M3 if has_scales else 0.0)
            r, s, sh = usage(K._quantize_group_columns_kernel, constexprs, warps, x_type)
            print(f"| quantize_group_columns | {block_c} columns x {block_r} rows, x {x_type[1:]} | {warps} | "
                  f"{block_c * block_r // (32 * warps)} | {r} | {s} | {sh} | {programs_per_sm(r, warps)} |",
                  flush=True)
    # The tiled route (LAUNCH["group_columns_tiles"]): one tile a program, no loop over the rows.
    for block_c, block_r, warps in ((64, 128, 4), (64, 64, 4), (32, 64, 8)):
        for x_type, has_scales in (("*bf16", False), ("*fp8e4nv", True)):
            tiled = dict(BLOCK_R=block_r, BLOCK_C=block_c, HAS_SCALES=has_scales, LOG2_G=7,
                         X_FP8_MAX=E4M3 if has_scales else 0.0)
            for name, kernel, constexprs in (("tiles' amax", K._quantize_tiles_amax_kernel, tiled),
                                             ("tiles' cast", K._quantize_tiles_cast_kernel, dict(tiled, FP8_MAX=E4M3))):
                r, s, sh = usage(kernel, constexprs, warps, x_type)
                print(f"| quantize_group_columns, {name} | {block_c} columns x {block_r} rows, x {x_type[1:]} | "
                      f"{warps} | {block_c * block_r // (32 * warps)} | {r} | {s} | {sh} | "
                      f"{programs_per_sm(r, warps)} |", flush=True)


if __name__ == "__main__":
    main()
