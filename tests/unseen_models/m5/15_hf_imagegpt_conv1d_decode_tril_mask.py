"""ImageGPT in the shape of transformers' modeling_imagegpt.py (written from memory, in my own
words): GPT-2's skeleton -- `transformer.wte`, learned `transformer.wpe`, blocks `transformer.h.N`
with `ln_1`, `attn` (Conv1D `c_attn` fused q|k|v with bias, `c_proj`), `ln_2`, `mlp` (Conv1D c_fc /
c_proj, quick_gelu), `transformer.ln_f` -- with ImageGPT's own ImageGPTLayerNorm (divide by the root
mean square, multiply by a weight; no centring, no bias) and an untied `lm_head` without bias.
Scores divided by sqrt(head_dim) via a torch.full scalar, finfo.min fill.  4 heads of 16, 3 layers.
Token ids are ordinary ids here (vocab 150, no sos handling).

Cache (hf): out = model(prompt, use_cache=True); out = model(tok, past_key_values=out.past_key_values,
use_cache=True).  past_key_values is a tuple per layer of (key, value), (batch, heads, seq, 16);
positions start at past_key_values[0][0].size(-2).

Slip (decoding only): instead of slicing GPT-2's `bias` buffer at rows key_length - query_length ..
key_length, the attention builds `torch.tril(torch.ones(query_length, key_length))`, which is only
right when there is no past: a one-token step gets row 0 and sees key 0 alone.  Decode:
`cache_mask`, step 0, `transformer.h.0.attn`.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["transformer.h.0.attn", "transformer.h.1.attn", "transformer.h.2.attn"],
    "kind": "causal-multihead",
    "cache": "hf",
    "decode": {"mistake": "cache_mask", "step": 0, "layer": "transformer.h.0.attn"},
    "style": "modeling_imagegpt.py: GPT-2 Conv1D skeleton, RMS-style ImageGPTLayerNorm, quick_gelu, untied head, "
    "tuple cache; slip: causal mask tril(q_len, k_len) without the past offset",
}


class ImageGPTConfig:
    vocab_size = 150
    n_positions = 64
    n_embd = 64
    n_layer = 3
    n_head = 4
    layer_norm_epsilon = 1e-5


class ImageGPTLayerNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, tensor):
        tensor = tensor / torch.sqrt(
            torch.mean(torch.square(tensor), axis=-1, keepdim=True) + self.eps
        )
        return tensor * self.weight


class Conv1D(nn.Module):
    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.09)
        self.bias = nn.Parameter(torch.randn(nf) * 0.02)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


class ImageGPTAttention(nn.Module):
    def __init__(self, config, layer_idx=None):
        super().__init__()
        self.embed_dim = config.n_embd
        self.num_heads = config.n_head
        self.head_dim = self.embed_dim // self.num_heads
        self.split_size = self.embed_dim
        self.layer_idx = layer_idx
        self.c_attn = Conv1D(3 * self.embed_dim, self.embed_dim)
        self.c_proj = Conv1D(self.embed_dim, self.embed_dim)

    def _attn(self, query, key, value):
        attn_weights = torch.matmul(query, key.transpose(-1, -2))
        attn_weights = attn_weights / torch.full(
            [], value.size(-1) ** 0.5, dtype=attn_weights.dtype
        )
        query_length, key_length = query.size(-2), key.size(-2)
        causal_mask = torch.tril(torch.ones(query_length, key_length, dtype=torch.bool))
        mask_value = torch.full([], torch.finfo(attn_weights.dtype).min, dtype=attn_weights.dtype)
        attn_weights = torch.where(causal_mask, attn_weights, mask_value)
        attn_weights = F.softmax(attn_weights, dim=-1)
        return torch.matmul(attn_weights, value), attn_weights

    def _split_heads(self, tensor):
        new_shape = tensor.size()[:-1] + (self.num_heads, self.head_dim)
        return tensor.view(*new_shape).permute(0, 2, 1, 3)

    def _merge_heads(self, tensor):
        tensor = tensor.permute(0, 2, 1, 3).contiguous()
        return tensor.view(tensor.size()[:-2] + (self.num_heads * self.head_dim,))

    def forward(self, hidden_states, layer_past=None, use_cache=False):
        query, key, value = self.c_attn(hidden_states).split(self.split_size, dim=2)
        query = self._split_heads(query)
        key = self._split_heads(key)
        value = self._split_heads(value)
        if layer_past is not None:
            past_key, past_value = layer_past
            key = torch.cat((past_key, key), dim=-2)
            value = torch.cat((past_value, value), dim=-2)
        present = (key, value) if use_cache else None
        attn_output, _ = self._attn(query, key, value)
        return self.c_proj(self._merge_heads(attn_output)), present


class ImageGPTMLP(nn.Module):
    def __init__(self, intermediate_size, config):
        super().__init__()
        self.c_fc = Conv1D(intermediate_size, config.n_embd)
        self.c_proj = Conv1D(config.n_embd, intermediate_size)

    def forward(self, hidden_states):
        h = self.c_fc(hidden_states)
        return self.c_proj(h * torch.sigmoid(1.702 * h))


class ImageGPTBlock(nn.Module):
    def __init__(self, config, layer_idx=None):
        super().__init__()
        self.ln_1 = ImageGPTLayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = ImageGPTAttention(config, layer_idx=layer_idx)
        self.ln_2 = ImageGPTLayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = ImageGPTMLP(4 * config.n_embd, config)

    def forward(self, hidden_states, layer_past=None, use_cache=False):
        residual = hidden_states
        attn_output, present = self.attn(self.ln_1(hidden_states), layer_past, use_cache)
        hidden_states = attn_output + residual
        return hidden_states + self.mlp(self.ln_2(hidden_states)), present


class ImageGPTModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList([ImageGPTBlock(config, layer_idx=i) for i in range(config.n_layer)])
        self.ln_f = ImageGPTLayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        if past_key_values is None:
            past_length = 0
            past_key_values = tuple([None] * len(self.h))
        else:
            past_length = past_key_values[0][0].size(-2)
        input_shape = input_ids.size()
        position_ids = torch.arange(
            past_length, input_shape[-1] + past_length, dtype=torch.long
        ).unsqueeze(0)
        hidden_states = self.wte(input_ids) + self.wpe(position_ids)
        presents = () if use_cache else None
        for block, layer_past in zip(self.h, past_key_values):
            hidden_states, present = block(hidden_states, layer_past, use_cache)
            if use_cache:
                presents = presents + (present,)
        return self.ln_f(hidden_states), presents


class CausalLMOutputWithCrossAttentions:
    def __init__(self, logits, past_key_values):
        self.logits = logits
        self.past_key_values = past_key_values


class ImageGPTForCausalImageModeling(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transformer = ImageGPTModel(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden_states, presents = self.transformer(input_ids, past_key_values, use_cache)
        return CausalLMOutputWithCrossAttentions(self.lm_head(hidden_states), presents)


def make_model():
    torch.manual_seed(6515)
    model = ImageGPTForCausalImageModeling(ImageGPTConfig())
    with torch.no_grad():
        model.transformer.wte.weight.mul_(0.5)
        model.transformer.wpe.weight.mul_(0.3)
        for m in model.modules():
            if isinstance(m, ImageGPTLayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
    return model.eval()
