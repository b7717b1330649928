"""fp32 CPU linears over a weight packed once for MKL's or oneDNN's GEMM, and this project's GEMV.

The fp32 tier (the default policy's ``large``) reads 540 MB of weights per step; a plain
``F.linear`` repacks its weight on every call. ``use_packed_fp32_linears`` swaps the model's large
linears for ``PackedFp32Linear``, which packs once for the library this CPU runs faster
(``fp32_gemm_backend``).

Batch invariance (the policy's ``batch_invariant``, on by default): a row's logits must not depend
on the other rows of its step. Neither library promises that, and neither does switching kernels
by row count. Measured on an Intel Xeon (AVX512, AMX) VM, a row alone vs inside a batch:
- plain ``F.linear`` differs from 2 rows on, on every SmolLM2-135M shape;
- oneDNN's packed GEMM differs from 2 rows on for the 576 x 1536 down projection;
- MKL's packed GEMM, used at every row count (1 to 300), is bitwise the same on every shape;
- the shipped large tier (MKL packed at 4-16 rows, plain elsewhere) gave one decode row's logits
  4.9e-5 apart alone vs beside 7 decodes.
So an invariant linear takes one packed GEMM at every row count, and the library is chosen by
checking the property on this CPU (``is_batch_invariant``: once per shape and library, on the
layer's own weight) rather than assumed by vendor: the faster library, else the other, else this
project's ``f32_linear`` at every row count (invariant by construction, slower on long chunks).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Literal

import torch
from torch import nn

from tiers.kernels.cpu import cpu_is_intel

__all__ = [
    "F32_GEMV_MAX_ROWS",
    "PACKED_MIN_WEIGHT_ELEMENTS",
    "Fp32Backend",
    "PackedFp32Linear",
    "direct_call",
    "fp32_gemm_backend",
    "is_batch_invariant",
    "onednn_fp32_supported",
    "packed_fp32_supported",
    "use_packed_fp32_linears",
]

log = logging.getLogger(__name__)


def _f32_gemv_max_rows() -> int:
    from tiers.kernels.cpu import host_isa

    return 2 if host_isa() == "AVX512" and not cpu_is_intel() else 0


F32_GEMV_MAX_ROWS = _f32_gemv_max_rows()
"""Up to this many rows the oneDNN-packed fp32 projections run ``tiered_router::f32_linear``
(tiers/kernels/csrc/f32_gemv.cpp), which reads the plain ``[out, in]`` weight at memory speed. Fixed per
instruction set and vendor, measured where set:
- AVX512, AMD (the 2-core Zen 4 VM): up to 2. SmolLM2-135M's fp32 projections, a whole step's
  worth (30 layers' weights cycled, 540 MB): 16.4 vs 23.4 ms at 1 row (1.43x), 18.6 vs 24.4 at 2
  (1.31x); from 3 rows oneDNN's packed GEMM reaches ~32 GB/s and wins (0.90x at 3, 0.75x at 5).
- Elsewhere 0 (off). AVX2 (Zen 1 VM): a step's projections 41 vs 57 ms at 1-2 rows, but there
  oneDNN serves every row count batch-invariant, and the switch would end that; Intel: not measured.
A batch-invariant linear (``PackedFp32Linear(invariant=True)``, the policy default) never switches."""


def _f32_gemv_op() -> Any | None:
    from tiers.kernels.cpu import f32_linear_op

    return f32_linear_op()


Fp32Backend = Literal["mkl", "onednn", "kernel"]
"""A packed GEMM library, or ``kernel``: this project's ``tiered_router::f32_linear`` at every row
count (the last resort of a batch-invariant linear; no packed copy)."""


def fp32_gemm_backend() -> Fp32Backend:
    """Which packed fp32 GEMM this CPU runs faster: MKL's on Intel, oneDNN's elsewhere.

    Why by vendor: MKL takes slower code paths on CPUs it does not recognise as Intel's. On this
    project's AMD EPYC (Zen 4) VM (benchmarks/results/linear_kernels.json) plain MKL took 10.4 ms
    for SmolLM2-135M's 49k-row head at one row and MKL's packed GEMM 17.3 ms at four; oneDNN's
    packed GEMM took 5.3 and 4.4 ms, and won at every row count from 1 to 512 on every shape.
    On the Intel Xeon VMs of earlier runs MKL was the faster one (a oneDNN decode step at one row
    measured 42 vs 32 ms), so Intel keeps it. A fixed rule rather than timing both at load: the
    kernel, and so the last bits of every logit, must not change from one start to the next."""
    return "mkl" if cpu_is_intel() or not onednn_fp32_supported() else "onednn"  # never "kernel"


@functools.cache
def _announce(out_features: int, in_features: int, backend: str) -> None:
    """Once per shape and choice, not once per layer (a 30-layer model has 30 of each shape)."""
    log.info("fp32 %d x %d linears: %s, the batch-invariant choice here", out_features, in_features, backend)


class PackedFp32Linear(nn.Module):
    """fp32 CPU linear over a weight packed once for the GEMM library this CPU runs faster
    (``fp32_gemm_backend``), at the row counts where that measured faster than the plain
    ``F.linear``; the plain call elsewhere. With ``invariant`` one packed GEMM at every row count,
    from a library checked batch-invariant on this CPU (the module docstring says why).

    Why packed: a plain fp32 ``F.linear`` repacks its weight on every call, which at 4-16 rows
    costs more than the arithmetic. MKL (Intel): SmolLM2-135M's 49k-row head took 2.6 / 5.4 / 9.4 /
    8.2 ms at 1 / 4 / 8 / 16 rows plain and 2.3 / 3.6 / 4.3 / 5.6 ms packed; the fp32 tier's median
    decode step in-process went from 47 to 35 ms at 4 sequences and 66 to 53 ms at 16. Outside 4-16
    rows MKL's packed kernel measured no better (1-3 rows) or worse (from 17 rows; the head at 80
    rows 29 vs 18 ms on an earlier Intel VM; on the AVX512/AMX Xeon VM packed was at parity at 1-2
    rows, faster from 4 to 64 rows and slower at 256: 112 vs 72 ms for the head), so without
    ``invariant`` those calls keep the plain weight. oneDNN (other vendors) won at every row count
    (``fp32_gemm_backend``), so it serves all of them, except up to ``F32_GEMV_MAX_ROWS`` rows where
    this project's memory-speed kernel reads the plain weight faster (not with ``invariant``: a
    kernel switch by row count). Cost: the packed copy is as large as the weight (+540 MB for a
    135M fp32 model).

    ``torch.ops.mkl._mkl_linear`` is the op inductor emits for frozen fp32 linears; it takes the
    packed path only when the row count equals the ``batch_size`` argument, so each call passes its
    own row count. Neither library's packed layout depends on the row count it was packed for
    (``tests/tiers/layers/test_fp32_packed.py`` checks 1-33 rows of both against fp64).
    """

    MKL_PACKED_ROWS = range(4, 17)
    EVERY_ROW_COUNT = range(1, 1 << 62)

    def __init__(
        self, linear: nn.Linear, backend: Fp32Backend | None = None, *, invariant: bool = False
    ) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.invariant = invariant
        # The same Parameter, not a copy: a head tied to the embedding stays tied.
        self.weight = linear.weight
        self.bias = linear.bias
        preferred: Fp32Backend = backend or fp32_gemm_backend()
        self._pack(preferred)
        if not invariant or backend is not None or is_batch_invariant(self):
            return
        # The other library, then this project's GEMV at every row count: batch-invariant by
        # construction (f32_gemv.cpp), but it streams the weight again for every 4-6 rows, so a
        # long prompt chunk costs several times the library's GEMM.
        fallbacks: list[Fp32Backend] = ["onednn" if preferred == "mkl" else "mkl", "kernel"]
        for other in fallbacks:
            if _supported(other):
                self._pack(other)
                if is_batch_invariant(self):
                    _announce(*self._shape(), other)
                    return
        self._pack(preferred)
        log.warning(
            "no fp32 GEMM gives a %d x %d linear the same bits alone and batched on this CPU; "
            "greedy answers of this tier may depend on other traffic",
            *self._shape(),
        )

    def _shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def _pack(self, backend: Fp32Backend) -> None:
        self.backend: Fp32Backend = backend
        if backend == "kernel":
            self.packed_rows, self.gemv_max_rows = range(0), 1 << 62
            self.weight_packed = None
            return
        every = self.invariant or backend == "onednn"
        self.packed_rows = self.EVERY_ROW_COUNT if every else self.MKL_PACKED_ROWS
        self.gemv_max_rows = F32_GEMV_MAX_ROWS if backend == "onednn" and not self.invariant else 0
        with torch.no_grad():
            w = self.weight.detach().to(torch.float32).contiguous()
            rows = self.MKL_PACKED_ROWS.stop - 1
            if backend == "mkl":
                self.weight_packed = torch.ops.mkl._mkl_reorder_linear_weight(w, rows)
            else:
                self.weight_packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        rows = x2.shape[0]
        gemv = _f32_gemv_op() if rows <= self.gemv_max_rows else None
        if gemv is not None and x2.dtype == torch.float32:
            y = gemv(x2.contiguous(), self.weight.detach(), self.bias)
        elif rows in self.packed_rows and x2.dtype == torch.float32:
            x2 = x2.contiguous()
            if self.backend == "mkl":
                y = torch.ops.mkl._mkl_linear(x2, self.weight_packed, self.weight, self.bias, rows)
            else:
                y = torch.ops.mkldnn._linear_pointwise(x2, self.weight_packed, self.bias, "none", [], "")
        else:
            y = nn.functional.linear(x2, self.weight, self.bias)
        return y.reshape(*shape[:-1], self.out_features)


INVARIANCE_PROBE_ROWS = (2, 3, 4, 5, 8, 16, 17, 33, 64)
"""Row counts ``is_batch_invariant`` compares with rows alone: both sides of MKL's packed range,
the one- and two-row GEMV range, and a prompt chunk's worth."""

_invariance_seen: dict[tuple[str, int, int, bool], bool] = {}


def is_batch_invariant(mod: PackedFp32Linear) -> bool:
    """Whether ``mod`` gives each of 8 rows the same bits alone as inside batches of
    ``INVARIANCE_PROBE_ROWS`` rows, on this CPU: once per library, shape and bias per process
    (a GEMM's blocking depends on those, not on the weight's values)."""
    key = (mod.backend, mod.out_features, mod.in_features, mod.bias is not None)
    if key not in _invariance_seen:
        gen = torch.Generator().manual_seed(34)
        x = torch.randn(max(INVARIANCE_PROBE_ROWS), mod.in_features, generator=gen)
        with torch.no_grad():
            alone = torch.cat([mod(x[i : i + 1]) for i in range(8)])
            _invariance_seen[key] = all(
                torch.equal(mod(x[:rows])[: min(rows, 8)], alone[: min(rows, 8)])
                for rows in INVARIANCE_PROBE_ROWS
            )
    return _invariance_seen[key]


def direct_call(mod: PackedFp32Linear) -> Any:
    """``mod``'s kernel as one call on 2-D fp32 activations (``quantization.rewrite.direct_kernel``):
    the same op on the same tensors as ``forward``, so bitwise the module's, without its reshapes."""
    packed, weight, bias = mod.weight_packed, mod.weight.detach(), mod.bias
    if mod.backend == "kernel":
        kernel = _f32_gemv_op()
        return mod.forward if kernel is None else lambda x: kernel(x.contiguous(), weight, bias)
    if mod.backend == "mkl":
        if mod.packed_rows is not mod.EVERY_ROW_COUNT:
            return mod.forward
        mkl = torch.ops.mkl._mkl_linear
        return lambda x: mkl(x.contiguous(), packed, weight, bias, x.shape[0])
    op = torch.ops.mkldnn._linear_pointwise

    def onednn(x: torch.Tensor) -> torch.Tensor:
        return op(x.contiguous(), packed, bias, "none", [], "")

    gemv, limit = _f32_gemv_op(), mod.gemv_max_rows
    if gemv is None or limit <= 0:
        return onednn
    return lambda x: gemv(x.contiguous(), weight, bias) if x.shape[0] <= limit else onednn(x)


def _supported(backend: Fp32Backend) -> bool:
    if backend == "kernel":
        return _f32_gemv_op() is not None
    return packed_fp32_supported() if backend == "mkl" else onednn_fp32_supported()


def packed_fp32_supported() -> bool:
    return bool(torch._C.has_mkl) and hasattr(torch.ops.mkl, "_mkl_linear")


def onednn_fp32_supported() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


PACKED_MIN_WEIGHT_ELEMENTS = 1 << 16
"""Below this a weight is cache-resident: the plain kernel's repacking is cheap and the packed copy
would only add memory."""


def use_packed_fp32_linears(model: nn.Module, *, invariant: bool = False) -> nn.Module:
    """Swap the large fp32 CPU ``nn.Linear``s for ``PackedFp32Linear`` (no-op without the library);
    ``invariant``: each batch-invariant (``PackedFp32Linear``)."""
    if not _supported(fp32_gemm_backend()):
        return model
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (
                type(child) is nn.Linear
                and child.weight.device.type == "cpu"
                and child.weight.dtype == torch.float32
                and child.weight.numel() >= PACKED_MIN_WEIGHT_ELEMENTS
            ):
                setattr(parent, name, PackedFp32Linear(child, invariant=invariant))
    return model
