"""Build and load the project's own CPU kernels (``tiers/csrc``), with torch's ops as the fallback.

Why a build step: the one kernel here (``tiered_router::int4_mm``, a tiled int4 GEMM that
dequantizes each weight group once for all rows, bitwise equal to torch's AVX512 kernel) is
C++ with AVX512 intrinsics. ``make install`` compiles it with the system C++ compiler against the
installed torch (``python -m tiers.cpu_kernels``); the shared object's name carries a hash of the
source, torch's version and the flags, so a stale build is never loaded. Where it is not built
(an image without a compiler) or cannot apply (no AVX512 dispatch in torch), callers get ``None``
and keep using torch's kernel - slower at many rows, the same numbers.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = ["build", "int4_mm_op", "library_path"]

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "int4_mm.cpp"
_BUILD_DIR = _SOURCE.parent / "build"
_FLAGS: tuple[str, ...] = ("-O3", "-std=c++20", "-fPIC", "-shared", "-fopenmp")
_FLAGS += ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mfma")


def library_path() -> Path:
    """Where the build for this source, torch and flag set lives (whether or not it exists)."""
    h = hashlib.sha256()
    h.update(_SOURCE.read_bytes())
    h.update(torch.__version__.encode())
    h.update(" ".join(_FLAGS).encode())
    return _BUILD_DIR / f"tiered_router_int4-{h.hexdigest()[:16]}.so"


def build(compiler: str = "g++") -> Path:
    """Compile the kernel library if this exact build is missing; return its path.

    Raises ``subprocess.CalledProcessError`` (with the compiler's output) when compiling fails."""
    out = library_path()
    if out.exists():
        return out
    from torch.utils import cpp_extension

    torch_lib = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [
        compiler,
        *_FLAGS,
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{p}" for p in cpp_extension.include_paths()),
        str(_SOURCE),
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
    for old in out.parent.glob("tiered_router_int4-*.so"):
        if old != out:
            old.unlink(missing_ok=True)
    return out


@functools.cache
def int4_mm_op() -> Any | None:
    """``torch.ops.tiered_router.int4_mm`` when built and applicable here, else ``None``.

    Applicable means torch dispatches its AVX512 int4 kernel on this CPU: that kernel's arithmetic
    is the one ours reproduces bit for bit, so swapping between them never changes an output."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512" or not _SOURCE.exists():
        return None
    path = library_path()
    if not path.exists():
        log.info("tiled int4 CPU kernel not built (%s); using torch's int4 kernel", path.name)
        return None
    torch.ops.load_library(str(path))
    return torch.ops.tiered_router.int4_mm


def main() -> int:
    try:
        path = build()
    except subprocess.CalledProcessError as e:
        sys.stderr.write(e.stderr or "")
        sys.stderr.write(f"building {_SOURCE} failed (exit {e.returncode})\n")
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
