"""A compact reference decoder-only transformer, for when transformers is not installed.

Two families from one code path, chosen by the spec's flags:
- GPT-2 (learned positions, LayerNorm with bias, GELU MLP, tied head): as
  transformers/models/gpt2/modeling_gpt2.py, with dropout 0;
- Llama (rotary positions, RMSNorm, gated SiLU MLP, grouped-query attention, optional qkv bias,
  tied or untied head): as transformers/models/llama/modeling_llama.py.
Parameter shapes match `zeroplan.estimate.model.layout.param_layout` tensor for tensor. Attention is
`F.scaled_dot_product_attention(is_causal=True)` ("sdpa") or written out with the a x s x s
score and probability matrices ("eager"). Selective checkpointing recomputes the attention core
only (Korthikanti et al. 2022, section 4.2): the block keeps q, k, v and the core's output.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from zeroplan.errors import MeasureError
from zeroplan.spec.model import TransformerSpec


def family(spec: TransformerSpec) -> str:
    return "gpt2" if spec.position_embedding == "learned" else "llama"


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # LlamaRMSNorm: normalise in fp32, scale in the input dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _norm(spec: TransformerSpec) -> nn.Module:
    return nn.LayerNorm(spec.hidden_size, eps=1e-5) if spec.norm == "layernorm" else RMSNorm(spec.hidden_size)


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # rotate_half as in modeling_llama.apply_rotary_pos_emb; x is (B, heads, T, d)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eager: bool) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + causal mask) v; q is (B, a, T, d), k and v (B, kv heads, T, d)."""
    if not eager:  # grouped-query k, v are broadcast by the kernel (transformers' sdpa_attention does the same)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    seq = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, a, T, T)
    mask = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
    probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1, dtype=torch.float32).to(q.dtype)
    return probs @ v


class Attention(nn.Module):
    def __init__(self, spec: TransformerSpec, eager: bool, recompute_core: bool):
        super().__init__()
        h, d = spec.hidden_size, spec.dim_per_head
        self.heads, self.kv_heads, self.head_dim = spec.num_heads, spec.kv_heads, d
        self.q_proj = nn.Linear(h, spec.num_heads * d, bias=spec.attention_bias)
        self.k_proj = nn.Linear(h, spec.kv_heads * d, bias=spec.attention_bias)
        self.v_proj = nn.Linear(h, spec.kv_heads * d, bias=spec.attention_bias)
        self.o_proj = nn.Linear(spec.num_heads * d, h, bias=spec.attention_out_bias)
        self.eager, self.recompute_core = eager, recompute_core

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        B, T, _ = x.shape  # batch, sequence length, width
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = _rotary(q, *rope), _rotary(k, *rope)
        if self.kv_heads != self.heads and self.eager:  # grouped-query attention: repeat_kv in modeling_llama
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        if self.recompute_core:
            out = checkpoint(attention_core, q, k, v, self.eager, use_reentrant=False)
        else:
            out = attention_core(q, k, v, self.eager)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, spec: TransformerSpec):
        super().__init__()
        h, inner, bias = spec.hidden_size, spec.intermediate_size, spec.mlp_bias
        self.gated = spec.mlp == "gated"
        if self.gated:
            self.gate_proj = nn.Linear(h, inner, bias=bias)
        self.up_proj = nn.Linear(h, inner, bias=bias)
        self.down_proj = nn.Linear(inner, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:  # LlamaMLP: down(silu(gate(x)) * up(x))
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))  # GPT-2's gelu_new


class Block(nn.Module):
    def __init__(self, spec: TransformerSpec, eager: bool, recompute_core: bool):
        super().__init__()
        self.attn_norm = _norm(spec)
        self.attn = Attention(spec, eager, recompute_core)
        self.mlp_norm = _norm(spec)
        self.mlp = MLP(spec)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope)  # pre-norm residual blocks (both families)
        return x + self.mlp(self.mlp_norm(x))


class ReferenceCausalLM(nn.Module):
    """Embeddings, `num_layers` blocks, final norm, output head; forward returns the mean loss."""

    def __init__(self, spec: TransformerSpec, *, eager: bool = False, recompute_attention_core: bool = False):
        super().__init__()
        if spec.is_moe:
            raise MeasureError("model: the reference implementation has no mixture-of-experts; install transformers")
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.embed_positions = (
            nn.Embedding(spec.max_position_embeddings, spec.hidden_size) if spec.position_embedding == "learned" else None
        )
        self.layers = nn.ModuleList(Block(spec, eager, recompute_attention_core) for _ in range(spec.num_layers))
        self.final_norm = _norm(spec)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.dim_per_head = spec.dim_per_head
        if spec.position_embedding == "rotary":
            self.register_buffer("inv_freq", self._inv_freq(), persistent=False)
        for module in self.modules():  # GPT-2 / Llama initializer_range 0.02
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def _inv_freq(self) -> torch.Tensor:
        d = self.dim_per_head
        return 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))  # rope_theta 1e4

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Recompute the rotary frequencies (after `to_empty` on a model built on meta)."""
        if self.embed_positions is None:
            self.inv_freq.copy_(self._inv_freq())

    def _rope(self, seq: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.embed_positions is not None:
            return None
        positions = torch.arange(seq, device=self.inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(positions, self.inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)  # (T, d)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The final norm's output (B, T, h), which the output head reads."""
        B, T = input_ids.shape
        x = self.embed_tokens(input_ids)  # (B, T, h)
        if self.embed_positions is not None:
            x = x + self.embed_positions(torch.arange(T, device=input_ids.device))
        rope = self._rope(T, x.dtype)
        for block in self.layers:
            x = block(x, rope)
        return self.final_norm(x)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.hidden(input_ids))  # (B, T, vocab)
        # ForCausalLMLoss (transformers/loss/loss_utils.py): fp32 logits, predict token t+1 from t
        # by shifting the labels (padded with the ignored index), not by slicing the logits
        shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), shifted.reshape(-1), ignore_index=-100)
