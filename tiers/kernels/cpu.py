"""Build and load the project's own CPU kernels (``tiers/kernels/csrc``), with torch's ops as the fallback.

Why a build step: the kernels here are C++ with AVX512 or AVX2 intrinsics (one build per host, for
the instruction set torch dispatches there), each bitwise equal to the torch ops it replaces -
``tiered_router::int4_mm`` (int4_mm.cpp: a tiled int4 GEMM that dequantizes each weight group once
for all rows) and ``tiered_router::add_rms_norm`` (rms_norm.cpp: the
residual add and HF's RMSNorm in one pass instead of ~8 torch ops) - and
``tiered_router::paged_attention`` (paged_attention.cpp: attention of a few query tokens per row
read in place from the paged KV pool, fp32 softmax; not bitwise torch's flash kernel, which it
replaces only on the fast path's short-query groups) and ``tiered_router::rope_kv_write``
(rope_kv.cpp: q/k rotary embedding plus the layer's K/V write, bitwise the torch ops),
``tiered_router::f32_linear`` (f32_gemv.cpp: the fp32 tier's one- and two-row projections) and
``tiered_router::w4a8_mm`` (w4a8_mm.cpp: int4 weights times per-group int8 activations, integer dot
products; bitwise ``tiers.layers.quantization.int4.w4a8_reference``, for tiers with
``activation_quantization: int8``)
and ``tiered_router::w8_linear`` (w8_linear.cpp: int8 weights times bf16 activations, the int8
layers' and int8 output heads' projections at every row count).
``make install`` compiles them
into one shared object with the system C++ compiler against the installed torch (``python -m
tiers.kernels.cpu``); its name carries a hash of every source, torch's version and the flags, so a
stale build is never loaded. Where it is not built (an image without a compiler) or cannot apply
(torch dispatches neither AVX512 nor AVX2), callers get ``None`` and keep using torch's ops - slower,
the same numbers.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "ISA_FLAGS",
    "add_rms_norm_op",
    "build",
    "cpu_is_intel",
    "host_isa",
    "int4_mm_op",
    "library_path",
    "paged_attention_op",
    "rope_kv_write_op",
    "w4a8_mm_op",
    "w8_linear_op",
    "w8a8_linear_op",
]

log = logging.getLogger(__name__)

_SOURCE_DIR = Path(__file__).with_name("csrc")
_BUILD_DIR = _SOURCE_DIR / "build"
# -ffp-contract=off: the kernels promise torch's exact roundings, so the compiler must not fuse a
# separate multiply and add into one FMA.
_BASE_FLAGS: tuple[str, ...] = ("-O3", "-std=c++20", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off")
ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "AVX512": ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mfma"),
    "AVX2": ("-mavx2", "-mfma", "-mf16c"),
}
"""Compiler flags per instruction set, keyed by ``torch.backends.cpu.get_cpu_capability()``.

Why the build follows torch's dispatch rather than the CPU's flags: int4_mm.cpp reproduces the
arithmetic and packed layout of the int4 kernel torch runs on this host, and those differ between
torch's AVX512 and AVX2 builds; compiling for the same instruction set keeps the two in step."""


@functools.cache
def cpu_is_intel() -> bool:
    """Whether this host's CPU is Intel's: some kernel choices (``layers/quantization/int4.py``)
    were measured to flip with the vendor (MKL's dispatch, FMA throughput), and are fixed per
    vendor, not timed at each start."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("vendor_id") and "GenuineIntel" in line for line in f)
    except OSError:
        return "intel" in platform.processor().lower()


def host_isa() -> str | None:
    """The instruction set torch dispatches on this host, where the kernels have a build for it."""
    cap = torch.backends.cpu.get_cpu_capability()
    return cap if cap in ISA_FLAGS else None


def _flags(isa: str | None = None) -> tuple[str, ...]:
    return _BASE_FLAGS + ISA_FLAGS[isa or host_isa() or "AVX2"]


def _sources() -> list[Path]:
    return sorted(_SOURCE_DIR.glob("*.cpp"))


def library_path(isa: str | None = None) -> Path:
    """Where the build for this source, torch and instruction set (the host's by default) lives,
    whether or not it exists."""
    h = hashlib.sha256()
    for src in [*_sources(), *sorted(_SOURCE_DIR.glob("*.h"))]:  # headers too: they are compiled in
        h.update(src.name.encode())
        h.update(src.read_bytes())
    h.update(torch.__version__.encode())
    flags = _flags(isa)
    h.update(" ".join(flags).encode())
    name = (isa or host_isa() or "AVX2").lower()
    return _BUILD_DIR / f"tiered_router_kernels-{name}-{h.hexdigest()[:16]}.so"


def build(compiler: str | None = None, isa: str | None = None) -> Path:
    """Compile the kernel library for ``isa`` (the host's by default) with ``compiler`` (``$CXX``,
    else ``g++``) if this exact build is missing; return its path.

    Raises ``FileNotFoundError`` when the compiler is missing and ``subprocess.CalledProcessError``
    (with the compiler's output) when compiling fails."""
    compiler = compiler or os.environ.get("CXX") or "g++"
    out = library_path(isa)
    if out.exists():
        return out
    from torch.utils import cpp_extension

    torch_lib = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [
        compiler,
        *_flags(isa),
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{p}" for p in cpp_extension.include_paths()),
        *(str(src) for src in _sources()),
        f"-L{torch_lib}",
        f"-Wl,-rpath,{torch_lib}",
        "-ltorch_cpu",
        "-lc10",
        "-o",
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp.so")
    subprocess.run([*cmd, str(tmp)], check=True, capture_output=True, text=True)
    tmp.replace(out)  # atomic: a concurrent loader never sees a half-written library
    current = {library_path(i).name for i in ISA_FLAGS}  # another ISA's build of these sources stays
    for old in out.parent.glob("tiered_router_kernels-*.so"):
        if old.name not in current:
            old.unlink(missing_ok=True)
    return out


@functools.cache
def _library_loaded() -> bool:
    """Loads the build once; False where it is missing or cannot apply.

    Applicable means torch dispatches its AVX512 or AVX2 kernels on this CPU: the build is
    compiled for that instruction set, and its kernels reproduce the arithmetic of the torch
    kernels that run there bit for bit, so swapping between them never changes an output."""
    if host_isa() is None or not _sources():
        return False
    path = library_path()
    if not path.exists():
        log.info("CPU kernels not built (%s); using torch's ops", path.name)
        return False
    torch.ops.load_library(str(path))
    return True


def int4_mm_op() -> Any | None:
    """``torch.ops.tiered_router.int4_mm`` (torch's ``_weight_int4pack_mm_for_cpu`` signature)
    when built and applicable here, else ``None``."""
    return torch.ops.tiered_router.int4_mm if _library_loaded() else None


def add_rms_norm_op() -> Any | None:
    """``torch.ops.tiered_router.add_rms_norm(h, delta, weight, eps) -> (h + delta, norm)``, the
    fused residual add + HF RMSNorm, when built and applicable here, else ``None``."""
    return torch.ops.tiered_router.add_rms_norm if _library_loaded() else None


def paged_attention_op() -> Any | None:
    """``torch.ops.tiered_router.paged_attention(q, pool, block_table, starts, q_len, scale)``,
    causal attention of ``q_len`` queries per row over one layer's paged KV pool, when built and
    applicable here, else ``None``."""
    return torch.ops.tiered_router.paged_attention if _library_loaded() else None


def rope_kv_write_op() -> Any | None:
    """``torch.ops.tiered_router.rope_kv_write(qkv, cos, signed_sin, pool, slots, heads, kv_heads)
    -> q``: rotary embedding of q and k and one layer's K/V write into the paged pool, bitwise the
    fast path's torch ops (rope_kv.cpp), when built and applicable here, else ``None``."""
    return torch.ops.tiered_router.rope_kv_write if _library_loaded() else None


def f32_linear_op() -> Any | None:
    """``torch.ops.tiered_router.f32_linear(x, weight, bias) -> x @ weight.T + bias`` for fp32 and
    a few rows, reading ``weight`` in its ``[out, in]`` layout at memory speed (f32_gemv.cpp),
    when built and applicable here, else ``None``."""
    return torch.ops.tiered_router.f32_linear if _library_loaded() else None


def w4a8_mm_op() -> Any | None:
    """``torch.ops.tiered_router.w4a8_mm(a, w, group_size, scales_and_zeros)``: int4 weights in
    ``tiers.layers.quantization.int4.pack_w4a8``'s layout times bf16 activations quantized to int8 per group
    (w4a8_mm.cpp; bitwise ``tiers.layers.quantization.int4.w4a8_reference``), when built and applicable
    here, else
    ``None``."""
    return torch.ops.tiered_router.w4a8_mm if _library_loaded() else None


def w8_linear_op() -> Any | None:
    """``torch.ops.tiered_router.w8_linear(x, weight, scale) -> (x @ weight.T) * scale``: int8
    ``[out, in]`` weights with one scale per output channel times 2-D bf16 activations, fp32 sums
    rounded to bf16 - ``torch._weight_int8pack_mm``'s numerics up to the order of the sums, and
    batch-invariant (w8_linear.cpp) - when built and applicable here, else ``None``."""
    return torch.ops.tiered_router.w8_linear if _library_loaded() else None


def w8a8_linear_op() -> Any | None:
    """``torch.ops.tiered_router.w8a8_linear(a, w, group_size, scale)``: int8 weights in
    ``tiers.layers.quantization.int8.pack_w8a8``'s layout with one fp32 scale per output channel times bf16
    activations quantized to int8 per group (w8a8_linear.cpp; bitwise
    ``tiers.layers.quantization.int8.w8a8_reference``),
    when built and applicable here, else ``None``."""
    return torch.ops.tiered_router.w8a8_linear if _library_loaded() else None


def main(argv: list[str] | None = None) -> int:
    """``python -m tiers.kernels.cpu [--isa all|AVX2|AVX512]``: build for the host's instruction
    set (default) or the named ones (an image built on one CPU and run on others: ``all``).

    No compiler is not an error: the tiers run torch's ops (the same numbers, slower batches), so
    an install never fails for want of one. A compiler that rejects the sources is (exit 1)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m tiers.kernels.cpu", description=main.__doc__)
    ap.add_argument("--isa", default=None, help="all, AVX2 or AVX512 (default: the host's)")
    args = ap.parse_args(argv)
    isas = list(ISA_FLAGS) if args.isa == "all" else [args.isa] if args.isa else [host_isa()]
    if isas == [None]:
        cap = torch.backends.cpu.get_cpu_capability()
        print(f"no CPU kernels for torch's {cap} dispatch; using torch's ops")
        return 0
    compiler = os.environ.get("CXX") or "g++"
    if all(not library_path(isa).exists() for isa in isas) and shutil.which(compiler) is None:
        sys.stderr.write(
            f"warning: no C++ compiler ({compiler!r} not found): the CPU kernels in {_SOURCE_DIR} are "
            "not built and the tiers run torch's ops (same outputs, 1.5-2.5x slower batches). "
            "Install g++ (or set CXX) and run `python -m tiers.kernels.cpu` to build them.\n"
        )
        return 0
    for isa in isas:
        if isa not in ISA_FLAGS:
            sys.stderr.write(f"unknown instruction set {isa!r}; known: {', '.join(ISA_FLAGS)}\n")
            return 2
        try:
            path = build(compiler, isa)
        except subprocess.CalledProcessError as e:
            sys.stderr.write(e.stderr or "")
            sys.stderr.write(f"building the kernels in {_SOURCE_DIR} failed (exit {e.returncode})\n")
            return 1
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
