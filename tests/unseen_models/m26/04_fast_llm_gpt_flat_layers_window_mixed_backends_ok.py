"""ServiceNow Fast-LLM's GPT model (ServiceNow/Fast-LLM, fast_llm/models/gpt and
fast_llm/layers/transformer/attention.py) in plain torch.  GPTModel keeps one flat `layers` list:
layers.0 is the LanguageModelEmbedding, layers.1..N are TransformerLayers (norm_1, self_attn, norm_2,
mlp), the last is the LanguageModelHead -- so the attention layers are layers.1.self_attn onwards.
Attention: `query` Linear, fused `key_value` Linear (chunked into k and v over head_groups), `dense`;
rotary kept in Fast-LLM's complex (interleaved pairs) format, frequencies from the model's kwargs;
softmax scale kv_channels**-0.5; window_size from the config (flash window (w - 1, 0)).  Each layer
runs one of two backends from `attention_backends`: "flash" (flash_attn_func, emulated with SDPA and a
boolean causal/window mask) or "backup" (_attn_backup: baddbmm over (b*groups, sq*heads_per_group, sk),
torch.where with finfo.min, softmax, bmm; the window by mask.triu_(-window + 1)).
No cache: `model(ids)` returns the logits tensor.
Correct: 3 transformer layers (flash, backup, flash), GQA 4/2, window_size 6, rotary theta 10000.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {'target': 'make_model',
 'ok': True,
 'layers': ['layers.1.self_attn', 'layers.2.self_attn', 'layers.3.self_attn'],
 'kind': 'causal-multihead',
 'cache': None,
 'style': 'Fast-LLM GPTModel: flat layers list (embedding at layers.0), self_attn with query / '
          'fused key_value / dense, complex-format rotary, per-layer flash or backup backend; GQA '
          '4/2, window 6'}


def get_rotary_frequencies(kv_channels, theta, sequence_length):
    """DefaultRotary: complex frequencies exp(i * pos * theta^(-2k/d)), (seq, kv_channels/2)."""
    freqs = theta ** -(torch.arange(0, kv_channels, 2, dtype=torch.float64) / kv_channels)
    angles = torch.outer(torch.arange(sequence_length, dtype=torch.float64), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary_embeddings(tensor, rotary_frequencies):
    """Fast-LLM keeps queries and keys in the complex (interleaved) format: (b, s, h, d)."""
    complex_tensor = torch.view_as_complex(tensor.to(torch.float64).unflatten(-1, (-1, 2)).contiguous())
    rotated = complex_tensor * rotary_frequencies[None, :, None, :]
    return torch.view_as_real(rotated).flatten(-2).to(tensor.dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self._eps = eps

    def forward(self, input_):
        return input_ * torch.rsqrt(input_.pow(2).mean(-1, keepdim=True) + self._eps) * self.weight


class Attention(nn.Module):
    """fast_llm.layers.transformer.attention.Attention: query, key_value (fused k and v), dense."""

    def __init__(self, config, layer_index, backend):
        super().__init__()
        self._config = config
        self._layer_index = layer_index  # 1-based: layers.0 is the embedding
        self._backend = backend
        self.kv_channels = config.kv_channels
        self.num_heads = config.num_attention_heads
        self.head_groups = config.head_groups
        self._local_heads_per_group = self.num_heads // self.head_groups
        self._softmax_scale = self.kv_channels**-0.5
        self.window_size = config.window_size
        hidden = config.hidden_size
        self.query = nn.Linear(hidden, self.num_heads * self.kv_channels, bias=config.add_linear_biases)
        self.key_value = nn.Linear(hidden, 2 * self.head_groups * self.kv_channels, bias=config.add_linear_biases)
        self.dense = nn.Linear(self.num_heads * self.kv_channels, hidden, bias=config.add_linear_biases)

    def _backup_attention_mask(self, sequence_length, device):
        mask = torch.ones((sequence_length, sequence_length), dtype=torch.bool, device=device).tril_()
        if self.window_size is not None:
            mask.triu_(-self.window_size + 1)
        return mask

    def _attn_backup(self, query, key, value):
        # query (b, sq, h, d); key/value (b, sk, g, d)
        b, sq = query.shape[:2]
        sk = key.shape[1]
        query = query.unflatten(2, (self.head_groups, self._local_heads_per_group)).transpose(1, 2)
        query = query.reshape(b * self.head_groups, sq * self._local_heads_per_group, self.kv_channels)
        key = key.movedim(1, 2).flatten(0, 1)
        value = value.movedim(1, 2).flatten(0, 1)
        attn_weights = torch.empty(
            (b * self.head_groups, sq * self._local_heads_per_group, sk), device=query.device, dtype=query.dtype
        )
        attn_weights = torch.baddbmm(attn_weights, query, key.transpose(-1, -2), beta=0, alpha=self._softmax_scale)
        attn_weights = attn_weights.view(b, self.head_groups, sq, self._local_heads_per_group, sk)
        mask = self._backup_attention_mask(sk, query.device)[None, None, :, None, :]
        mask_value = torch.full([], torch.finfo(attn_weights.dtype).min, dtype=attn_weights.dtype)
        attn_weights = torch.where(mask, attn_weights, mask_value)
        attn_weights = torch.softmax(attn_weights, dim=-1)
        attn_weights = attn_weights.view(b * self.head_groups, sq * self._local_heads_per_group, sk)
        attn_output = torch.bmm(attn_weights, value)
        attn_output = attn_output.view(b, self.head_groups, sq, self._local_heads_per_group, self.kv_channels)
        return attn_output.permute(0, 2, 1, 3, 4).flatten(2)

    def _attn_flash(self, query, key, value):
        # stands in for flash_attn_func(..., causal=True, window_size=(window - 1, 0))
        sq, sk = query.shape[1], key.shape[1]
        q = query.transpose(1, 2)
        k = key.repeat_interleave(self._local_heads_per_group, dim=2).transpose(1, 2)
        v = value.repeat_interleave(self._local_heads_per_group, dim=2).transpose(1, 2)
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        allowed = j <= i
        if self.window_size is not None:
            allowed = allowed & (i - j <= self.window_size - 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self._softmax_scale)
        return out.transpose(1, 2).flatten(2)

    def forward(self, input_, kwargs):
        b, s, _ = input_.shape
        query = self.query(input_).unflatten(-1, (self.num_heads, self.kv_channels))
        key_value = self.key_value(input_).unflatten(-1, (2 * self.head_groups, self.kv_channels))
        key, value = key_value.chunk(2, dim=2)
        frequencies = kwargs["rotary_freq"][:s]
        query = apply_rotary_embeddings(query, frequencies)
        key = apply_rotary_embeddings(key, frequencies)
        if self._backend == "flash":
            out = self._attn_flash(query, key, value)
        else:
            out = self._attn_backup(query, key, value)
        return self.dense(out)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer_1 = nn.Linear(config.hidden_size, 2 * config.ffn_hidden_size, bias=False)
        self.layer_2 = nn.Linear(config.ffn_hidden_size, config.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.layer_1(x).chunk(2, dim=-1)
        return self.layer_2(F.silu(gate) * up)


class TransformerLayer(nn.Module):
    def __init__(self, config, layer_index, backend):
        super().__init__()
        self.norm_1 = RMSNorm(config.hidden_size)
        self.self_attn = Attention(config, layer_index, backend)
        self.norm_2 = RMSNorm(config.hidden_size)
        self.mlp = MLP(config)

    def forward(self, input_, kwargs):
        hidden = input_ + self.self_attn(self.norm_1(input_), kwargs)
        return hidden + self.mlp(self.norm_2(hidden))


class LanguageModelEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings_weight = nn.Parameter(torch.randn(config.vocab_size, config.hidden_size))

    def forward(self, input_ids, kwargs):
        return F.embedding(input_ids, self.word_embeddings_weight)


class LanguageModelHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.final_norm = RMSNorm(config.hidden_size)
        self.output_weights = nn.Parameter(torch.randn(config.vocab_size, config.hidden_size) / 8.0)

    def forward(self, hidden, kwargs):
        return F.linear(self.final_norm(hidden), self.output_weights)


class GPTModel(nn.Module):
    """fast_llm.models.gpt.model.GPTModel: one flat `layers` list, embedding first, head last."""

    def __init__(self, config):
        super().__init__()
        self._config = config
        layout = config.attention_backends
        self.layers = nn.ModuleList(
            [LanguageModelEmbedding(config)]
            + [TransformerLayer(config, i + 1, layout[i]) for i in range(config.num_layers)]
            + [LanguageModelHead(config)]
        )

    def forward(self, input_ids):
        kwargs = {
            "rotary_freq": get_rotary_frequencies(self._config.kv_channels, self._config.rotary_theta, input_ids.shape[1])
        }
        x = input_ids
        for layer in self.layers:
            x = layer(x, kwargs)
        return x


def make_model():
    torch.manual_seed(2604)
    config = SimpleNamespace(
        vocab_size=96, hidden_size=64, num_layers=3, num_attention_heads=4, head_groups=2,
        kv_channels=64 // 4, ffn_hidden_size=128, add_linear_biases=False, rotary_theta=10000.0,
        window_size=6, attention_backends=["flash", "backup", "flash"],
    )
    model = GPTModel(config)
    g = torch.Generator().manual_seed(2604 + 1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()
