"""Compile the device codec's kernels for a GPU without one: Triton's own compiler, ahead of time.

Triton's interpreter (how CI runs the kernels) executes them with numpy and skips everything
the compiler checks: types, constexpr rules, what LLVM and ptxas make of the arithmetic. This
module feeds every kernel of ``triton_kernels`` through the real pipeline (TTIR -> LLVM ->
PTX -> cubin, with the ptxas that ships in the triton wheel) for a chosen NVIDIA target, so a
CPU-only machine proves the kernels build and can read the PTX they became (no fused
multiply-adds; IEEE division; no denormal flushed to zero), which is what bit-exactness on the
GPU rests on.

Run it in a process WITHOUT ``TRITON_INTERPRET`` set (under the interpreter the kernels are not
compilable objects): ``python -m tail_ray.compression.triton_aot``.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tail_ray.compression import lowrank_device as LD
from tail_ray.compression import triton_kernels as K


@dataclass(frozen=True)
class Built:
    name: str
    ptx: str
    cubin_bytes: int

    def fused_multiply_adds(self) -> int:
        """FMA instructions of float32/float64 math in the PTX (the grid forbids them)."""
        return len(re.findall(r"\bfma\.rn\.f(32|64)\b", self.ptx))

    def approximate_divisions(self) -> int:
        return len(re.findall(r"\bdiv\.(approx|full)\.f32\b", self.ptx))

    def flushes_to_zero(self) -> int:
        """Instructions that flush denormals to zero (``.ftz``): the CPU grid keeps them
        (``tl.floor`` compiles to ``cvt.rmi.ftz``, which is why the dither kernel floors by
        truncation)."""
        return len(re.findall(r"\.ftz\b", self.ptx))


_P32, _P64 = "*fp32", "*fp64"


def _variants() -> list[tuple[str, object, dict[str, str], dict[str, object]]]:
    # The seed (32 bits) launches as i32 below 2^31 and i64 from there: i64 is built here (the
    # i32 variant only sign-extends a non-negative value).
    quant_sig = {
        "g_ptr": _P32, "e_ptr": _P32, "scales_ptr": _P32, "levels_ptr": "*u8", "nnz_ptr": "*i32",
        "err_sq_ptr": _P64, "tab_ptr": "*i32", "n": "i32", "bucket_size": "i32", "seed": "i64",
        "lmax": "i32", "inv_l": "fp32", "packed_bytes": "i32",
    }  # fmt: skip
    out: list[tuple[str, object, dict[str, str], dict[str, object]]] = []
    # Each rounding is its own compiled kernel: dither (Tail's default), nearest, stochastic.
    roundings = (("dither", False, True), ("nearest", True, False), ("stochastic", False, False))
    for tag, nearest, dither in roundings:
        mode = {"NEAREST": nearest, "DITHER": dither}
        for bits in (2, 3, 4, 8):
            out.append((f"quantize_ef_pack{bits}_{tag}", K._quantize_kernel, quant_sig,
                        {"BLOCK": 512, "USE_E": True, "PACK_BITS": bits, **mode}))  # fmt: skip
        out.append((f"quantize_int8_{tag}", K._quantize_kernel, {**quant_sig, "levels_ptr": "*i8"},
                    {"BLOCK": 128, "USE_E": False, "PACK_BITS": 0, **mode}))  # fmt: skip
    dither_2k: dict[str, object] = {
        "BLOCK": 2048,
        "USE_E": False,
        "PACK_BITS": 4,
        "NEAREST": False,
        "DITHER": True,
    }
    out.append(
        ("quantize_pack4_dither_2k", K._quantize_kernel, quant_sig, dither_2k)
    )  # two chunks of uniforms
    out.append(("pack4", K._pack_kernel,
                {"levels_ptr": "*i8", "out_ptr": "*u8", "n": "i32", "lmax": "i32", "packed_bytes": "i32"},
                {"BLOCK": 1024, "BITS": 4}))  # fmt: skip
    out.append(("dequantize3", K._dequantize_kernel,
                {"packed_ptr": "*u8", "scales_ptr": _P32, "out_ptr": _P32, "n": "i32", "bucket_size": "i32",
                 "lmax": "i32", "inv_l": "fp32"},
                {"BLOCK": 1024, "BITS": 3}))  # fmt: skip
    for dither in (False, True):
        out.append(("mean_dither" if dither else "mean", K._mean_kernel,
                    {"levels_ptr": "*i8", "steps_ptr": _P32, "bucket_ptr": "*i64", "seeds_ptr": "*i64",
                     "tab_ptr": "*i32", "out_ptr": _P32, "n": "i32", "world": "i32", "steps_stride": "i32"},
                    {"BLOCK": 1024, "DITHER": dither}))  # fmt: skip
    for tag, nearest, dither in roundings:
        out.append((f"bucket_errors_{tag}", K._bucket_errors_kernel,
                    {"g_ptr": _P32, "e_ptr": _P32, "ids_ptr": "*i64", "n_ids": "i32", "n": "i32",
                     "bucket_size": "i32", "lmax_ptr": "*i32", "out_ptr": _P64},
                    {"USE_E": True, "NC": 6, "NC_POW2": 8, "NEAREST": nearest,
                     "DITHER": dither}))  # fmt: skip
    out.append(("lowrank_reconstruct", LD._reconstruct_kernel,
                {"p_ptr": _P32, "q_ptr": _P32, "out_ptr": _P32, "rows": "i32", "cols": "i32", "rank": "i32"},
                {"BLOCK_R": 32, "BLOCK_C": 64}))  # fmt: skip
    out.append(("sum_squares", K._sum_squares_kernel, {"x_ptr": _P32, "partial_ptr": _P64, "n": "i32"},
                {"BLOCK": 1024}))  # fmt: skip
    return out


def build_all(arch: int = 90) -> list[Built]:
    """Compile every kernel variant the codec launches for ``sm_<arch>``; raises on failure."""
    target = GPUTarget("cuda", arch, 32)
    built = []
    for name, fn, sig, consts in _variants():
        signature = {**sig, **{k: "constexpr" for k in consts}}
        src = ASTSource(fn=fn, signature=signature, constexprs=consts)
        kernel = triton.compile(src, target=target, options={"enable_fp_fusion": False})
        built.append(Built(name, kernel.asm["ptx"], len(kernel.asm["cubin"])))
    return built


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="NVIDIA compute capability x10 (90: H100/H200)")
    args = ap.parse_args(argv)
    bad = 0
    for b in build_all(args.arch):
        fma, approx, ftz = b.fused_multiply_adds(), b.approximate_divisions(), b.flushes_to_zero()
        bad += fma + approx + ftz
        print(f"{b.name:20s} cubin {b.cubin_bytes:7d} B   fma {fma}   approx div {approx}   ftz {ftz}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
