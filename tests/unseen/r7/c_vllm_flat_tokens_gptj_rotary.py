"""vLLM-style GPT-J block on a flattened token batch: positions per token, forward context with seq_lens,
GPT-J (non-neox) rotary on the first quarter of each head, reference SDPA backend looping over sequences."""

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


# --------------------------------------------------------------------------- forward context
@dataclass
class AttentionMetadata:
    seq_lens: list
    query_start_loc: torch.Tensor


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata = None


_forward_context = ForwardContext()


def get_forward_context():
    return _forward_context


class set_forward_context:
    """with set_forward_context(metadata): ... -- installs the metadata for every Attention called inside."""

    def __init__(self, attn_metadata):
        self.attn_metadata = attn_metadata
        self.prev = None

    def __enter__(self):
        global _forward_context
        self.prev = _forward_context
        _forward_context = ForwardContext(attn_metadata=self.attn_metadata)

    def __exit__(self, *exc):
        global _forward_context
        _forward_context = self.prev
        return False


# --------------------------------------------------------------------------- rotary
def _apply_rotary_emb(x, cos, sin, is_neox_style):
    """x: (num_tokens, heads, rotary_dim); cos/sin: (num_tokens, rotary_dim // 2)."""
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    if is_neox_style:
        x1, x2 = torch.chunk(x, 2, dim=-1)
    else:
        x1 = x[..., ::2]
        x2 = x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox_style:
        return torch.cat((o1, o2), dim=-1)
    return torch.stack((o1, o2), dim=-1).flatten(-2)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_size, rotary_dim, max_position_embeddings, base, is_neox_style):
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        self.is_neox_style = is_neox_style
        self.register_buffer("cos_sin_cache", self._compute_cos_sin_cache(), persistent=False)

    def _compute_inv_freq(self, base):
        return 1.0 / (
            base ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float64) / self.rotary_dim)
        )

    def _compute_cos_sin_cache(self):
        inv_freq = self._compute_inv_freq(self.base)
        t = torch.arange(self.max_position_embeddings, dtype=torch.float64)
        freqs = torch.einsum("i,j -> ij", t, inv_freq)
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)

    def forward(self, positions, query, key):
        positions = positions.flatten()
        num_tokens = positions.shape[0]
        cos_sin = self.cos_sin_cache.index_select(0, positions)
        cos, sin = cos_sin.chunk(2, dim=-1)

        query_shape = query.shape
        query = query.view(num_tokens, -1, self.head_size)
        query_rot = query[..., : self.rotary_dim]
        query_pass = query[..., self.rotary_dim :]
        query_rot = _apply_rotary_emb(query_rot, cos, sin, self.is_neox_style)
        query = torch.cat((query_rot, query_pass), dim=-1).reshape(query_shape)

        key_shape = key.shape
        key = key.view(num_tokens, -1, self.head_size)
        key_rot = key[..., : self.rotary_dim]
        key_pass = key[..., self.rotary_dim :]
        key_rot = _apply_rotary_emb(key_rot, cos, sin, self.is_neox_style)
        key = torch.cat((key_rot, key_pass), dim=-1).reshape(key_shape)
        return query, key


def get_rope(head_size, rotary_dim, max_position, base, is_neox_style=True):
    return RotaryEmbedding(head_size, rotary_dim, max_position, base, is_neox_style)


# --------------------------------------------------------------------------- attention backend
class Attention(nn.Module):
    """Reference (non-paged) backend: one causal SDPA call per sequence of the flattened batch."""

    def __init__(self, num_heads, head_size, scale, num_kv_heads=None):
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads

    def forward(self, query, key, value):
        attn_metadata = get_forward_context().attn_metadata
        num_tokens = query.shape[0]
        query = query.view(num_tokens, self.num_heads, self.head_size)
        key = key.view(num_tokens, self.num_kv_heads, self.head_size)
        value = value.view(num_tokens, self.num_kv_heads, self.head_size)
        output = torch.empty_like(query)
        starts = attn_metadata.query_start_loc.tolist()
        for i, seq_len in enumerate(attn_metadata.seq_lens):
            start, end = starts[i], starts[i] + seq_len
            q = query[start:end].transpose(0, 1)
            k = key[start:end].transpose(0, 1)
            v = value[start:end].transpose(0, 1)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
            output[start:end] = out.transpose(0, 1)
        return output.view(num_tokens, self.num_heads * self.head_size)


# --------------------------------------------------------------------------- GPT-J
class GPTJAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.total_num_heads = config.n_head
        self.hidden_size = config.n_embd
        self.head_size = self.hidden_size // self.total_num_heads
        self.qkv_proj = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.out_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        scaling = self.head_size**-0.5
        assert getattr(config, "rotary", True)
        assert config.rotary_dim % 2 == 0
        self.rotary_emb = get_rope(
            self.head_size,
            rotary_dim=config.rotary_dim,
            max_position=config.max_position_embeddings,
            base=config.rope_theta,
            is_neox_style=False,
        )
        self.attn = Attention(self.total_num_heads, self.head_size, scaling)

    def forward(self, position_ids, hidden_states):
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.chunk(chunks=3, dim=-1)
        q, k = self.rotary_emb(position_ids, q, k)
        attn_output = self.attn(q, k, v)
        return self.out_proj(attn_output)


class GPTJMLP(nn.Module):
    def __init__(self, intermediate_size, config):
        super().__init__()
        self.fc_in = nn.Linear(config.n_embd, intermediate_size)
        self.fc_out = nn.Linear(intermediate_size, config.n_embd)

    def forward(self, hidden_states):
        return self.fc_out(F.gelu(self.fc_in(hidden_states), approximate="tanh"))


class GPTJBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = GPTJAttention(config)
        self.mlp = GPTJMLP(4 * config.n_embd, config)

    def forward(self, position_ids, hidden_states):
        residual = hidden_states
        hidden_states = self.ln_1(hidden_states)
        attn_output = self.attn(position_ids=position_ids, hidden_states=hidden_states)
        mlp_output = self.mlp(hidden_states)
        return attn_output + mlp_output + residual


class GPTJModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.h = nn.ModuleList([GPTJBlock(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    def forward(self, positions, hidden_states):
        for layer in self.h:
            hidden_states = layer(positions, hidden_states)
        return self.ln_f(hidden_states)


class ModelRunner(nn.Module):
    """Takes an unpadded (batch, seq, hidden) batch, flattens it to tokens and runs the model under a forward context."""

    def __init__(self, config):
        super().__init__()
        self.model = GPTJModel(config)

    def forward(self, inputs_embeds):
        bsz, seq_len, hidden = inputs_embeds.shape
        seq_lens = [seq_len] * bsz
        positions = torch.cat([torch.arange(n, device=inputs_embeds.device) for n in seq_lens])
        query_start_loc = torch.tensor([0] + seq_lens, device=inputs_embeds.device).cumsum(0)
        metadata = AttentionMetadata(seq_lens=seq_lens, query_start_loc=query_start_loc)
        with set_forward_context(metadata):
            out = self.model(positions, inputs_embeds.reshape(bsz * seq_len, hidden))
        return out.view(bsz, seq_len, hidden)


def make_runner():
    config = SimpleNamespace(
        n_embd=64,
        n_head=4,
        n_layer=1,
        rotary_dim=4,
        rope_theta=10000,
        max_position_embeddings=256,
        layer_norm_epsilon=1e-5,
    )
    return ModelRunner(config)


EXPECT = {
    "target": "make_runner",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "model.h.0.attn",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "interleaved", "fraction": 0.25, "base": 10000},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "vLLM GPTJAttention (qkv_proj.chunk(3), get_rope(is_neox_style=False) with cos_sin_cache.index_select(positions), Attention backend reading attn_metadata from the forward context, flattened (num_tokens, hidden) batch)",
}
