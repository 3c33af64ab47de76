"""IDEFICS (v1) language model used text-only (transformers modeling_idefics.py,
IdeficsForVisionText2Text without images: the perceiver, vision tower and gated cross-attention
layers are not built -- cross_layer_interval larger than the depth).

model (IdeficsModel: embed_tokens = IdeficsDecoupledEmbedding (a regular table plus
`additional_embedding` for ids >= num_embeddings), layers.N = IdeficsDecoderLayer (input_layernorm,
self_attn, post_attention_layernorm, mlp), norm) and lm_head = IdeficsDecoupledLinear (weight plus
`additional_fc` for the extra tokens, concatenated).  IdeficsAttention: q/k/v/o without bias, MHA 4 x 16,
rotary from IdeficsEmbedding (cos_cached / sin_cached built for max_position_embeddings in float64,
rotate_half, base 1e4) gathered by position_ids, qk_layer_norms off for self-attention, then SDPA with
the 4-D additive causal mask.  IdeficsRMSNorm, SiLU-gated mlp.
Slip: layer 1 was built with `apply_rotary_pos_emb` from a queries-only variant (written for a
"keys are pre-rotated in the cache" path that this model never uses), so its keys are not rotated
while its queries are.
No cache is used here (model(ids) is the full forward; returns logits).
"""

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "model.layers.0.self_attn",
        "model.layers.1.self_attn",
        "model.layers.2.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "model.layers.1.self_attn",
    "stage": "rotated_keys",
    "mistake": "rope_missing",
    "style": "modeling_idefics.py text path: IdeficsDecoupledEmbedding / IdeficsDecoupledLinear, IdeficsEmbedding "
    "cos/sin caches gathered by position_ids, SDPA with 4-D causal mask; layer 1 rotates the queries only",
}


class IdeficsDecoupledEmbedding(nn.Embedding):
    def __init__(self, num_embeddings, num_additional_embeddings, embedding_dim):
        super().__init__(num_embeddings, embedding_dim)
        self.num_additional_embeddings = num_additional_embeddings
        self.additional_embedding = nn.Embedding(num_additional_embeddings, embedding_dim)

    def forward(self, input_ids):
        input_ids = input_ids.clone()
        additional_vocab_indices = torch.where(input_ids >= self.num_embeddings)
        input_ids_additional_vocab = input_ids[additional_vocab_indices]
        additional_embeddings = self.additional_embedding(input_ids_additional_vocab - self.num_embeddings)
        input_ids[additional_vocab_indices] = 0
        full_vector = F.embedding(input_ids, self.weight)
        full_vector[additional_vocab_indices] = additional_embeddings
        return full_vector


class IdeficsDecoupledLinear(nn.Linear):
    def __init__(self, in_features, out_features, out_additional_features, bias=False):
        super().__init__(in_features, out_features, bias)
        self.additional_fc = nn.Linear(in_features, out_additional_features, bias=bias)

    def forward(self, input):
        output = F.linear(input, self.weight, self.bias)
        return torch.cat((output, self.additional_fc(input)), -1)


class IdeficsRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class IdeficsEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=64, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        t = torch.arange(max_position_embeddings, dtype=torch.float64)
        freqs = torch.einsum("i,j->ij", t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_cached = emb.cos()  # float64, cast at use
        self.sin_cached = emb.sin()

    def forward(self, x, seq_len=None):
        return self.cos_cached[:seq_len].to(dtype=x.dtype), self.sin_cached[:seq_len].to(dtype=x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids, unsqueeze_dim=1):
    cos = cos[position_ids].unsqueeze(unsqueeze_dim)
    sin = sin[position_ids].unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def apply_rotary_pos_emb_queries_only(q, k, cos, sin, position_ids, unsqueeze_dim=1):
    cos = cos[position_ids].unsqueeze(unsqueeze_dim)
    sin = sin[position_ids].unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    return q_embed, k


class IdeficsAttention(nn.Module):
    def __init__(self, config, rotary_fn=apply_rotary_pos_emb):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)
        self.rotary_emb = IdeficsEmbedding(self.head_dim, config.max_position_embeddings)
        self.rotary_fn = rotary_fn

    def forward(self, hidden_states, attention_mask=None, position_ids=None):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        kv_seq_len = key_states.shape[-2]
        cos, sin = self.rotary_emb(value_states, seq_len=max(kv_seq_len, q_len))
        query_states, key_states = self.rotary_fn(query_states, key_states, cos, sin, position_ids)
        attn_output = F.scaled_dot_product_attention(
            query_states, key_states, value_states, attn_mask=attention_mask, dropout_p=0.0
        )
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output)


class IdeficsMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class IdeficsDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        rotary_fn = apply_rotary_pos_emb_queries_only if layer_idx in config.queries_only_rope_layers \
            else apply_rotary_pos_emb
        self.self_attn = IdeficsAttention(config, rotary_fn)
        self.mlp = IdeficsMLP(config)
        self.input_layernorm = IdeficsRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = IdeficsRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None):
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), attention_mask, position_ids)
        hidden_states = residual + hidden_states
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


class IdeficsModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = IdeficsDecoupledEmbedding(
            config.vocab_size, config.additional_vocab_size, config.hidden_size
        )
        self.layers = nn.ModuleList([IdeficsDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = IdeficsRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids):
        bsz, seq_length = input_ids.shape
        position_ids = torch.arange(seq_length, device=input_ids.device).unsqueeze(0).expand(bsz, -1)
        inputs_embeds = self.embed_tokens(input_ids)
        dtype = inputs_embeds.dtype
        causal = torch.full((seq_length, seq_length), torch.finfo(dtype).min, dtype=dtype, device=input_ids.device)
        causal = torch.triu(causal, diagonal=1)[None, None].expand(bsz, 1, -1, -1)
        hidden_states = inputs_embeds
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, attention_mask=causal, position_ids=position_ids)
        return self.norm(hidden_states)


class IdeficsForVisionText2Text(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = IdeficsModel(config)
        self.lm_head = IdeficsDecoupledLinear(
            config.hidden_size, config.vocab_size, config.additional_vocab_size, bias=False
        )

    def forward(self, input_ids):
        return self.lm_head(self.model(input_ids))


def make_model():
    torch.manual_seed(1907)
    config = SimpleNamespace(
        vocab_size=92, additional_vocab_size=4, hidden_size=64, intermediate_size=160,
        num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=64, rms_norm_eps=1e-6,
        queries_only_rope_layers=(1,),
    )
    model = IdeficsForVisionText2Text(config)
    g = torch.Generator().manual_seed(19071)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, IdeficsRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()
