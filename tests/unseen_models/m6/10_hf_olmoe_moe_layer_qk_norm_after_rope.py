"""OLMoE (allenai/OLMoE-1B-7B, transformers' modeling_olmoe.py; written from memory, in my own
words): `model.embed_tokens`, `model.layers.N` pre-norm (input_layernorm, post_attention_layernorm,
RMSNorm), attention with q/k/v/o_proj (no bias) and a QK norm over the *whole* projection
(`q_norm` = RMSNorm(hidden), `k_norm` = RMSNorm(kv_heads × head_dim)) applied right after the
projections, before the head split and before the rotary (rotate_half, base 10000), MHA with 4 heads
of 16, hidden 64; the MLP is `OlmoeSparseMoeBlock` (router `gate`, 4 experts each a SwiGLU
OlmoeMLP, top-2, norm_topk_prob False); `model.norm`, untied lm_head.  3 layers, vocab 140.
No cache.  Returns an object with `.logits`.

Slip: layer 1 is an `OlmoeRotaryFirstAttention` (a port from a fused-kernel path) that splits the
heads and rotates queries and keys first and only then flattens them back and applies q_norm and
k_norm.  `model.layers.1.self_attn`, stage `normed_queries`, `qk_norm_misplaced`.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "model.layers.1.self_attn",
    "stage": "normed_queries",
    "mistake": "qk_norm_misplaced",
    "style": "modeling_olmoe.py: full-projection q_norm/k_norm before the head split, rotate_half rope, sparse MoE block "
    "(gate + 4 experts, top-2); slip: layer 1 rotates first and norms the rotated projections",
}


class OlmoeConfig:
    vocab_size = 140
    hidden_size = 64
    intermediate_size = 64
    num_hidden_layers = 3
    num_attention_heads = 4
    num_key_value_heads = 4
    rope_theta = 10000.0
    rms_norm_eps = 1e-5
    num_experts = 4
    num_experts_per_tok = 2
    norm_topk_prob = False
    attn_impl = ["eager", "rotary_first", "eager"]


class OlmoeRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class OlmoeRotaryEmbedding(nn.Module):
    def __init__(self, dim, base):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, position_ids):
        freqs = position_ids[:, :, None].double() * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class OlmoeAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False
        )
        self.v_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False
        )
        self.o_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.q_norm = OlmoeRMSNorm(self.hidden_size, eps=config.rms_norm_eps)
        self.k_norm = OlmoeRMSNorm(
            self.num_key_value_heads * self.head_dim, eps=config.rms_norm_eps
        )

    def _attend(self, query_states, key_states, value_states, attention_mask, bsz, q_len):
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_norm(self.q_proj(hidden_states))
        key_states = self.k_norm(self.k_proj(hidden_states))
        value_states = self.v_proj(hidden_states)
        query_states = query_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = key_states.view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(
            1, 2
        )
        value_states = value_states.view(
            bsz, q_len, self.num_key_value_heads, self.head_dim
        ).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        return self._attend(query_states, key_states, value_states, attention_mask, bsz, q_len)


class OlmoeRotaryFirstAttention(OlmoeAttention):
    def forward(self, hidden_states, position_embeddings, attention_mask):
        bsz, q_len, _ = hidden_states.size()
        query_states = (
            self.q_proj(hidden_states)
            .view(bsz, q_len, self.num_heads, self.head_dim)
            .transpose(1, 2)
        )
        key_states = (
            self.k_proj(hidden_states)
            .view(bsz, q_len, self.num_key_value_heads, self.head_dim)
            .transpose(1, 2)
        )
        value_states = self.v_proj(hidden_states)
        value_states = value_states.view(
            bsz, q_len, self.num_key_value_heads, self.head_dim
        ).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        query_states = self.q_norm(query_states.transpose(1, 2).reshape(bsz, q_len, -1))
        key_states = self.k_norm(key_states.transpose(1, 2).reshape(bsz, q_len, -1))
        query_states = query_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = key_states.view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(
            1, 2
        )
        return self._attend(query_states, key_states, value_states, attention_mask, bsz, q_len)


class OlmoeMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class OlmoeSparseMoeBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, self.num_experts, bias=False)
        self.experts = nn.ModuleList([OlmoeMLP(config) for _ in range(self.num_experts)])

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = (
            F.softmax(router_logits, dim=1, dtype=torch.float).to(hidden_states.dtype)
            if hidden_states.dtype != torch.float64
            else F.softmax(router_logits, dim=1)
        )
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        if self.norm_topk_prob:
            routing_weights = routing_weights / routing_weights.sum(dim=-1, keepdim=True)
        final = torch.zeros_like(hidden_states)
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in range(self.num_experts):
            idx, top_x = torch.where(expert_mask[expert_idx])
            if top_x.numel() == 0:
                continue
            current = hidden_states[top_x]
            out = self.experts[expert_idx](current) * routing_weights[top_x, idx, None]
            final.index_add_(0, top_x, out.to(hidden_states.dtype))
        return final.reshape(batch_size, sequence_length, hidden_dim)


class OlmoeDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        attn_cls = (
            OlmoeRotaryFirstAttention
            if config.attn_impl[layer_idx] == "rotary_first"
            else OlmoeAttention
        )
        self.self_attn = attn_cls(config, layer_idx)
        self.mlp = OlmoeSparseMoeBlock(config)
        self.input_layernorm = OlmoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = OlmoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        residual = hidden_states
        hidden_states = residual + self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings, attention_mask
        )
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


class CausalLMOutput:
    def __init__(self, logits):
        self.logits = logits


class OlmoeModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [OlmoeDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = OlmoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = OlmoeRotaryEmbedding(
            config.hidden_size // config.num_attention_heads, config.rope_theta
        )

    def forward(self, input_ids):
        hidden_states = self.embed_tokens(input_ids)
        seq_len = input_ids.shape[1]
        position_ids = torch.arange(seq_len)[None]
        mask = torch.full(
            (seq_len, seq_len), torch.finfo(hidden_states.dtype).min, dtype=hidden_states.dtype
        )
        mask = torch.triu(mask, diagonal=1)[None, None]
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings, mask)
        return self.norm(hidden_states)


class OlmoeForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = OlmoeModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids):
        return CausalLMOutput(self.lm_head(self.model(input_ids)))


def make_model():
    torch.manual_seed(6110)
    model = OlmoeForCausalLM(OlmoeConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, OlmoeRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
    return model.eval()
