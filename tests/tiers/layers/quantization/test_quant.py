"""Weight-only quantization: close to the fp32 layer, and the fused and dequantizing paths agree."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tiers.layers.fp32_packed import PackedFp32Linear
from tiers.layers.quantization.int4 import Int4WeightOnlyLinear
from tiers.layers.quantization.int8 import Int8WeightOnlyLinear
from tiers.layers.quantization.mixed_head import MixedHead
from tiers.layers.quantization.rewrite import quantize_model


@pytest.fixture
def linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(128, 96, bias=True)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def test_int8_is_close_to_fp32(linear: nn.Linear) -> None:
    x = torch.randn(5, 128)
    q = Int8WeightOnlyLinear(linear)
    assert rel_err(q(x.bfloat16()), linear(x)) < 0.02
    assert rel_err(q(x), linear(x)) < 0.01  # the dequantizing path (fp32 activations)


def test_int4_packed_and_dequantized_paths_agree(linear: nn.Linear) -> None:
    x = torch.randn(3, 128)
    q = Int4WeightOnlyLinear(linear, group_size=32)
    fused = q(x.bfloat16()).float()
    w = q._dequantized(torch.float32, _unpack_reference(linear, 32))
    manual = x @ w.T + linear.bias
    assert rel_err(fused, manual) < 0.02
    assert rel_err(fused, linear(x)) < 0.15


def _unpack_reference(linear: nn.Linear, gs: int) -> torch.Tensor:
    w = linear.weight.detach().reshape(linear.out_features, -1, gs)
    lo = w.amin(-1, keepdim=True)
    scale = ((w.amax(-1, keepdim=True) - lo) / 15).clamp(min=1e-8)
    return torch.clamp(torch.round((w - lo) / scale), 0, 15).reshape(linear.out_features, -1)


def test_int4_rejects_unaligned_features() -> None:
    with pytest.raises(ValueError, match="group_size"):
        Int4WeightOnlyLinear(nn.Linear(40, 8), group_size=32)


def _tiny_llama(vocab: int, layers: int) -> Any:
    """A random tied-embedding Llama: 64 wide, 4 heads over 2 KV heads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg)


def test_quantize_model_unties_the_head_and_rewrites_every_linear() -> None:
    model = _tiny_llama(vocab=64, layers=1)
    emb = model.get_input_embeddings().weight.detach().clone()
    quantize_model(model, "int4")
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert isinstance(model.lm_head, Int8WeightOnlyLinear)  # the head stays int8 even under int4
    assert torch.equal(model.get_input_embeddings().weight, emb)  # embeddings untouched


@pytest.mark.parametrize("int8_activations", [True, False])
def test_the_head_takes_int8_activations_beside_w4a8_layers(int8_activations: bool) -> None:
    """The medium tier's operating point (int4 g32 with int8 activations, int8 head): catches a head
    left on bf16 activations, or W8A8 leaking into a tier that asked for bf16 activations."""
    model = _tiny_llama(vocab=256, layers=1)
    quantize_model(model, "int4", group_size=32, int8_activations=int8_activations)
    head = model.lm_head
    assert isinstance(head, Int8WeightOnlyLinear)
    assert head.int8_activations == int8_activations and head.group_size == 32


@pytest.mark.parametrize("int8_activations", [True, False])
def test_mixed_head_is_the_int8_head_on_its_first_rows_and_the_int4_head_on_the_rest(
    int8_activations: bool,
) -> None:
    """Each output row is quantized on its own (int8: a scale per row; int4: per row and input
    group), so a mixed head's logits are bitwise the all-int8 head's on rows [0, 128) and the
    all-int4 head's on the rest, alone and in a batch. Catches a slice off by a block, the parts
    swapped, the tail quantized with another group size, or a part left on bf16 activations."""
    models = [_tiny_llama(vocab=320, layers=1) for _ in range(3)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    heads = []
    for m, kw in zip(models, [{"int8_head_rows": 128}, {}, {"int8_head_rows": 0}], strict=True):
        quantize_model(m, "int4", group_size=32, int4_head=bool(kw), int8_activations=int8_activations, **kw)
        heads.append(m.lm_head.to(torch.bfloat16))
    mixed, int8, int4 = heads
    assert isinstance(mixed, MixedHead) and isinstance(int8, Int8WeightOnlyLinear)
    assert isinstance(int4, Int4WeightOnlyLinear) and mixed.out_features == 320
    assert mixed.hot.int8_activations == mixed.cold.int8_activations == int8_activations
    x = torch.randn(5, 64).to(torch.bfloat16)
    got = mixed(x)
    assert got.shape == (5, 320)
    assert torch.equal(got[:, :128], int8(x)[:, :128])
    assert torch.equal(got[:, 128:], int4(x)[:, 128:])
    assert torch.equal(mixed(x[2:3]), got[2:3])  # a row alone is the row in the batch


@pytest.mark.parametrize(("rows", "head"), [(320, Int8WeightOnlyLinear), (0, Int4WeightOnlyLinear)])
def test_an_int4_head_keeping_every_or_no_row_int8_is_a_plain_head(rows: int, head: type) -> None:
    model = _tiny_llama(vocab=320, layers=1)
    quantize_model(model, "int4", group_size=32, int4_head=True, int8_head_rows=rows)
    assert type(model.lm_head) is head


@pytest.mark.parametrize("rows", [100, 320, 0])
def test_mixed_head_refuses_rows_it_cannot_split_at(rows: int) -> None:
    with pytest.raises(ValueError, match="int8_rows must be a multiple of 64"):
        MixedHead(nn.Linear(64, 320, bias=False), rows, 32, int8_activations=True)


@pytest.mark.parametrize(
    "kind", ["linear", "mkl_packed", "onednn_packed", "int8", "int4", "int4_int8_activations"]
)
def test_fused_projections_are_bitwise_equal_to_separate_ones(kind: str) -> None:
    """q/k/v fused into one call give exactly the separate outputs (the fast path relies on it)."""
    from torch import nn

    from tiers.layers.fusion import FusedSlice, fuse_linears
    from tiers.layers.quantization.int4 import Int4WeightOnlyLinear
    from tiers.layers.quantization.int8 import Int8WeightOnlyLinear

    torch.manual_seed(0)
    make = {
        "linear": lambda m: m,
        "mkl_packed": lambda m: PackedFp32Linear(m, "mkl"),
        "onednn_packed": lambda m: PackedFp32Linear(m, "onednn"),
        "int8": Int8WeightOnlyLinear,
        "int4": lambda m: Int4WeightOnlyLinear(m, 32),
        "int4_int8_activations": lambda m: Int4WeightOnlyLinear(m, 32, int8_activations=True),
    }[kind]
    mods = [make(nn.Linear(256, n, bias=False)) for n in (256, 64, 64)]
    fused = fuse_linears(mods)
    assert fused is not None and fused.out_features == 384
    x = torch.randn(5, 256, dtype=torch.float32 if "packed" in kind or kind == "linear" else torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(fused(x), torch.cat([m(x) for m in mods], dim=-1))
        assert torch.equal(FusedSlice(fused, 256, 320)(x), mods[1](x))


@pytest.mark.parametrize(
    ("sizes", "fusable"), [((64, 32, 32), False), ((96, 32), False), ((128, 64, 64), True)]
)
def test_int4_parts_fuse_only_in_whole_pack_blocks(sizes: tuple[int, ...], fusable: bool) -> None:
    """The CPU int4 layout interleaves channels within blocks of 64 outputs: parts that are not
    whole blocks are left unfused (concatenated they gave other channels' outputs), whole blocks
    fuse and stay bitwise equal."""
    from tiers.layers.fusion import fuse_linears

    torch.manual_seed(0)
    mods = [Int4WeightOnlyLinear(nn.Linear(64, n, bias=False), 32) for n in sizes]
    fused = fuse_linears(mods)
    assert (fused is not None) == fusable
    if fused is not None:
        x = torch.randn(5, 64, dtype=torch.bfloat16)
        assert torch.equal(fused(x), torch.cat([m(x) for m in mods], dim=-1))


def _w4a8_numpy(x: torch.Tensor, q: torch.Tensor, group: int, sz: torch.Tensor) -> torch.Tensor:
    """W4A8 as w4a8_mm.cpp defines it, in numpy: integer dots in int64, fp32 ops one at a time."""
    import numpy as np

    f32 = np.float32
    xf = x.float().numpy().reshape(x.shape[0], -1, group)
    qq = q.numpy().astype(np.int64).reshape(q.shape[0], -1, group)
    s, z = sz[..., 0].float().numpy(), sz[..., 1].float().numpy()
    out = np.zeros((x.shape[0], q.shape[0]), dtype=f32)
    for m in range(x.shape[0]):
        acc = np.zeros(q.shape[0], dtype=f32)
        for g in range(xf.shape[1]):
            amax = f32(np.abs(xf[m, g]).max())
            inv = f32(f32(127) / amax) if amax > 0 else f32(0)
            sa = f32(amax / f32(127))
            xq = np.rint(xf[m, g] * inv).astype(np.int64)  # rint: half to even
            dots = (qq[:, g] * xq).sum(-1)
            z8 = (z[g] - s[g] * f32(8)).astype(f32)
            c = (dots.astype(f32) * (s[g] * sa).astype(f32)).astype(f32)
            c = (c + (z8 * f32(sa * f32(xq.sum()))).astype(f32)).astype(f32)
            acc = (acc + c).astype(f32)
        out[m] = acc
    return torch.from_numpy(out).to(torch.bfloat16)


def test_w4a8_reference_is_its_definition_and_close_to_the_dequantized_product() -> None:
    """The torch reference (what the kernel is tested against) against an independent numpy
    transcription of the definition, bit for bit: catches torch's ``127.0 / t`` (a reciprocal
    and a multiply, not a division), a dot product that is not exact, and the group order. Then
    against the bf16 path's dequantized weight in fp64: int8 activations stay within 2%."""
    from tiers.layers.quantization.int4 import w4a8_reference

    torch.manual_seed(0)
    for n, k, group, m in [(64, 128, 32, 3), (96, 256, 64, 5), (32, 256, 128, 2)]:
        q = torch.randint(0, 16, (n, k))
        sz = torch.stack([torch.rand(k // group, n) * 0.02, torch.randn(k // group, n) * 0.01], -1).to(
            torch.bfloat16
        )
        x = (torch.randn(m, k) * 3).to(torch.bfloat16)
        x[0, :group] = 0
        ref = w4a8_reference(x, q, group, sz)
        assert torch.equal(ref.view(torch.int16), _w4a8_numpy(x, q, group, sz).view(torch.int16))
        scale, zero = (sz[..., i].double().T[..., None] for i in (0, 1))
        w = (q.double().reshape(n, -1, group) - 8) * scale + zero
        dense = x.double() @ w.reshape(n, k).T
        assert rel_err(ref, dense) < 0.02


def test_int8_activations_quantize_every_int4_linear_and_stay_close(linear: nn.Linear) -> None:
    """``quantize_model(..., int8_activations=True)`` reaches every int4 layer (the head too with
    ``int4_head``), and the layer stays close to its bf16-activation twin."""
    torch.manual_seed(0)
    model = _tiny_llama(vocab=128, layers=2)
    quantize_model(model, "int4", group_size=32, int4_head=True, int8_activations=True)
    int4 = [m for m in model.modules() if isinstance(m, Int4WeightOnlyLinear)]
    assert len(int4) == 2 * 7 + 1 and all(m.int8_activations for m in int4)
    a8 = Int4WeightOnlyLinear(linear, 32, int8_activations=True)
    bf16 = Int4WeightOnlyLinear(linear, 32)
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        assert rel_err(a8(x), bf16(x)) < 0.02
        assert not torch.equal(a8(x), bf16(x))  # the numbers are W4A8's, not bf16's
