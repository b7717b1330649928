"""A lean forward pass for Llama-family decoders (Llama, Qwen2, Mistral), over HF's own modules.

Why: at the batch sizes a tier decodes, a step of a small model is dominated by Python and
dispatch overhead, not FLOPs. HF's layer stack spends ~10 ms per step of SmolLM2-135M on wrappers,
kwargs plumbing, mask helpers and unfused small ops - as much as the int4 matmuls themselves, so it
set the floor on how cheap a draft step could be. This path calls the same weights (the very
``nn.Linear``/quantized modules and the model's own rotary-embedding module, so every RoPE
variant HF supports is computed by HF), and attention laid out as HF's SDPA integration does it.

It reproduces HF's arithmetic op for op (fp32 RMSNorm statistics, the same rotary formula, SDPA
with the same mask), so logits match the generic path to float noise; on AVX512 and AVX2 CPUs
short query groups (decode, verification, short chunks) instead run the paged attention kernel
(``tiers/kernels/csrc/paged_attention.cpp``: fp32 softmax over the pool in place), equal to SDPA within
float noise in fp32 and bf16 noise in bf16; ``tests/tiers`` checks that
on tiny Llama and Qwen2 models. Anything else - other architectures, sliding windows, attention
softcapping - keeps the generic path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from tiers.attention import selector
from tiers.attention.selector import AttentionBackend, attend

if TYPE_CHECKING:
    from tiers.attention.flex import AttnGroup

__all__ = ["FastDecoder", "supports_fast_path"]

_SUPPORTED = {"llama", "qwen2", "mistral"}


def supports_fast_path(model: Any) -> bool:
    cfg = model.config.get_text_config()
    if cfg.model_type not in _SUPPORTED:
        return False
    if getattr(cfg, "sliding_window", None) and getattr(
        cfg, "use_sliding_window", cfg.model_type == "mistral"
    ):
        return False
    if getattr(cfg, "attn_logit_softcapping", None):
        return False
    base = model.base_model
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    return all(hasattr(base, n) for n in needed) and getattr(cfg, "hidden_act", "silu") == "silu"


class FastDecoder:
    def __init__(self, model: Any, *, paged_every_query: bool = False) -> None:
        self.paged_every_query = paged_every_query
        """The paged kernel also serves prompt chunks over ``selector.PAGED_ATTENTION_MAX_Q_LEN`` queries:
        one kernel for every query length makes a row's logits independent of chunk boundaries
        (batch invariance, the policy's ``batch_invariant``)."""
        self.base = model.base_model
        cfg = model.config.get_text_config()
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.scale = self.head_dim**-0.5
        self.group = self.num_heads // self.num_kv_heads
        self.dtype = self.base.embed_tokens.weight.dtype
        self.layers = [self._fused_layer(layer) for layer in self.base.layers]
        self.norm_weight = self.base.norm.weight
        self.norm_eps = self.base.norm.variance_epsilon
        self._fused_norm = self._fused_norm_op()
        device = self.base.embed_tokens.weight.device
        # The attention backends (tiers/attention/selector.py): the CPU kernel, FlexAttention.
        self._paged_attention = selector.paged_attention_op(device, self.head_dim, self.group, self.dtype)
        self._rope_kv = self._rope_kv_op()
        self.flex_attention = selector.flex_attention_fn(device)
        """FlexAttention over the pool in place (``tiers/attention/flex.py``) for every query length:
        on CUDA (compiled), or on the CPU with ``TIERED_ROUTER_ATTENTION=flex`` (eager: the CPU
        tests run the GPU path's Python) or ``flex-compile``. ``None``: the CPU kernel or gather + SDPA."""

    def _rope_kv_op(self) -> Any | None:
        """The fused RoPE + K/V write kernel where it applies: a CPU model of bf16 or fp32 (the pool
        and HF's cos/sin have the model's dtype, the case its bitwise contract covers)."""
        from tiers.kernels import cpu as cpu_kernels

        op = cpu_kernels.rope_kv_write_op()
        if op is None or self.base.embed_tokens.weight.device.type != "cpu":
            return None
        return op if self.dtype in (torch.bfloat16, torch.float32) and self.head_dim % 2 == 0 else None

    def paged_attention_serves(self, q_len: int) -> bool:
        """Whether attention of a group with ``q_len`` queries per row runs the paged kernel
        (then the group needs no mask and no gathered copy of its blocks)."""
        return selector.paged_attention_serves(self._paged_attention, q_len, self.paged_every_query)

    @property
    def uses_flex(self) -> bool:
        """Every group runs FlexAttention: the runner builds its block mask (``AttnGroup.flex``)."""
        return self.flex_attention is not None

    def _fused_norm_op(self) -> Any | None:
        """The fused residual add + RMSNorm kernel where it applies: CPU weights, norm weights in
        the activation dtype (its bitwise contract covers exactly that case)."""
        from tiers.kernels import cpu as cpu_kernels

        op = cpu_kernels.add_rms_norm_op()
        weights = [self.norm_weight] + [w for layer in self.layers for w in (layer[0], layer[5])]
        if op is None or self.base.embed_tokens.weight.device.type != "cpu":
            return None
        if any(w.dtype != self.dtype or w.dim() != 1 or not w.is_contiguous() for w in weights):
            return None
        return op

    @staticmethod
    def _fuse(owner: Any, names: tuple[str, ...]) -> tuple[Any, list[int]]:
        """One projection module for ``names`` of ``owner`` (q/k/v, gate/up) and the split sizes.
        The originals become slices of it, so the weights exist once; a second runner on the same
        model finds the fused module already there."""
        from tiers.layers.fusion import FusedSlice, fuse_linears

        mods = [getattr(owner, n) for n in names]
        sizes = [int(m.out_features) for m in mods]
        if all(isinstance(m, FusedSlice) for m in mods) and len({id(m.fused) for m in mods}) == 1:
            return mods[0].fused, sizes
        fused = fuse_linears(mods)
        if fused is None:  # unfusable mix: call them one by one
            return mods, sizes
        start = 0
        for n, size in zip(names, sizes, strict=True):
            setattr(owner, n, FusedSlice(fused, start, start + size))
            start += size
        return fused, sizes

    def _fused_layer(self, layer: Any) -> tuple[Any, ...]:
        from tiers.layers.quantization.rewrite import direct_kernel

        attn, mlp = layer.self_attn, layer.mlp
        qkv, qkv_sizes = self._fuse(attn, ("q_proj", "k_proj", "v_proj"))
        gate_up, gu_sizes = self._fuse(mlp, ("gate_proj", "up_proj"))

        def call(mod: Any) -> Any:  # what could not be fused stays a list of calls
            if isinstance(mod, list):
                return [direct_kernel(m, self.dtype) for m in mod]
            return direct_kernel(mod, self.dtype)

        return (
            layer.input_layernorm.weight,
            layer.input_layernorm.variance_epsilon,
            call(qkv),
            qkv_sizes,
            call(attn.o_proj),
            layer.post_attention_layernorm.weight,
            layer.post_attention_layernorm.variance_epsilon,
            call(gate_up),
            gu_sizes,
            call(mlp.down_proj),
        )

    @staticmethod
    def _project(fn: Any, x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        if isinstance(fn, list):
            return [f(x) for f in fn]
        return list(fn(x).split(sizes, dim=-1))  # no hooks on these: Module.__call__ is skipped

    @staticmethod
    def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # As HF: statistics in fp32, then back to the activation dtype before the weight.
        # F.rms_norm is that formula in one kernel (bitwise the same on the CPU: tests/tiers).
        return weight * F.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=eps).to(x.dtype)

    def _add_norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``h + delta`` (the residual stream; ``delta`` None for the first layer) and its norm."""
        if self._fused_norm is not None and (delta is None or delta.dtype == h.dtype):
            h_new, y = self._fused_norm(h, delta, weight, eps)  # h_new is None without a delta
            return (h if delta is None else h_new), y
        if delta is not None:
            h = h + delta
        return h, self._rms_norm(h, weight, eps)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """HF's ``x * cos + rotate_half(x) * sin`` with the sign of rotate_half's first half
        folded into ``signed_sin`` (``(-a) * b == a * (-b)`` exactly), one op fewer per layer."""
        half = x.shape[-1] // 2
        return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin

    def _rope_and_write(
        self,
        qk_x: torch.Tensor,
        v_x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        pool: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """The torch ops ``rope_kv_write`` replaces: q and k rotated (elementwise, so rotating them
        together is bitwise the same as one by one), K and V of every new token written at its slot
        with one write per layer; returns q [n, heads, dim]."""
        n, heads, kv_heads, dim = qk_x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qk = self._rotate(qk_x.reshape(n, heads + kv_heads, dim), cos, sin)
        q, k = qk[:, :heads], qk[:, heads:]
        v = v_x.reshape(n, kv_heads, dim)
        pool.view(-1, 2, kv_heads, dim).index_copy_(0, slots, torch.stack((k, v), dim=1).to(pool.dtype))
        return q

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        groups: list[AttnGroup],
        kv_pool: torch.Tensor,
    ) -> torch.Tensor:
        """One forward over a flattened token stream.

        input_ids, positions, slots: [N] (slot = pool block * block_size + offset, where each
        token's K/V is written); groups: rows of equal query length, contiguous in the stream;
        kv_pool: [layers, blocks, block_size, 2, kv_heads, head_dim]. Returns hidden states [N, hidden].
        """
        n = input_ids.shape[0]
        h = self.base.embed_tokens(input_ids)  # [N, hidden]
        cos, sin = self.base.rotary_emb(h, positions[None])  # [1, N, head_dim]
        cos, sin = cos[0, :, None], sin[0, :, None]  # [N, 1, head_dim]
        half = self.head_dim // 2
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        same_dtype = cos.dtype == sin.dtype == kv_pool.dtype == self.dtype  # rope_kv_write's contract
        rope_kv = self._rope_kv if same_dtype else None
        if rope_kv is not None:
            cos2, sin2 = cos.reshape(n, dim).contiguous(), sin.reshape(n, dim).contiguous()
        delta: torch.Tensor | None = None  # the last sublayer's output, added to h by the next norm
        backend = AttentionBackend(
            self.flex_attention, self._paged_attention, self.scale, heads, kv_heads, dim
        )
        for i, (w_in, eps_in, qkv, qkv_sizes, o_p, w_post, eps_post, gate_up, gu_sizes, down) in enumerate(
            self.layers
        ):
            h, x = self._add_norm(h, delta, w_in, eps_in)
            pool = kv_pool[i]  # [blocks, block_size, 2, kv_heads, dim]
            # q, k, v side by side: one fused projection, or the parts that could not be fused
            y = torch.cat(self._project(qkv, x, qkv_sizes), dim=-1) if isinstance(qkv, list) else qkv(x)
            if rope_kv is not None:
                # One kernel: q and k rotated, this layer's K/V written at the tokens' slots.
                q = rope_kv(y.contiguous(), cos2, sin2, pool, slots, heads, kv_heads)
            else:  # q and k rotated together (elementwise: bitwise the same as one by one)
                split = qkv_sizes[0] + qkv_sizes[1]
                q = self._rope_and_write(y[:, :split], y[:, split:], cos, sin, pool, slots)
            out = torch.empty((n, heads, dim), dtype=q.dtype, device=q.device) if len(groups) > 1 else None
            for g in groups:
                rows, t = g.num_rows, g.q_len
                attn = attend(q[g.first : g.first + rows * t], pool, g, backend)
                if out is None:  # one group covers the whole stream
                    out = attn
                else:
                    out[g.first : g.first + rows * t] = attn
            assert out is not None
            h, x = self._add_norm(h, o_p(out.reshape(n, heads * dim)), w_post, eps_post)
            gate, up = self._project(gate_up, x, gu_sizes)
            delta = down(F.silu(gate) * up)
        return self._add_norm(h, delta, self.norm_weight, self.norm_eps)[1]
