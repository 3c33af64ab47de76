"""JetMoE (myshell-ai/JetMoE, HF transformers models/jetmoe, JetMoeAttention): Mixture of Attention
heads (MoA). A router (`experts.router.layer`, top-k of num_experts) picks, per token, top_k query
experts; each expert owns an input projection (`experts.input_linear`, hidden -> kv_projection_size)
and an output projection (`experts.output_linear`). Keys and values come from one shared `kv_proj`
(num_key_value_heads heads), repeated top_k times; the query heads of a token are the concatenation
of its selected experts' heads. rotate_half RoPE (JetMoeRotaryEmbedding), causal, the per-expert
outputs mixed by the router's softmax gates. JetMoeRMSNorm pre-norms.

This file: refused: Mixture of Attention heads: each token's query heads (and output projection) come from its top-2 of 4 routed experts, mixed by the router gates; shared kv_proj"""

import torch
from torch import nn


class JetMoeConfig:
    hidden_size = 64
    num_key_value_heads = 2
    kv_channels = 16
    num_local_experts = 4
    num_experts_per_tok = 2
    rope_theta = 10000.0
    rms_norm_eps = 1e-6
    intermediate_size = 128


class JetMoeRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class JetMoeTopKGating(nn.Module):
    def __init__(self, input_size, num_experts, top_k):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.layer = nn.Linear(input_size, num_experts, bias=False)

    def forward(self, hidden_states):
        logits = self.layer(hidden_states)
        top_k_logits, top_k_indices = logits.topk(self.top_k, dim=-1)
        top_k_gates = torch.softmax(top_k_logits, dim=-1)
        return top_k_indices, top_k_gates


class JetMoeParallelExperts(nn.Module):
    def __init__(self, num_experts, input_size, output_size):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, output_size, input_size))
        nn.init.normal_(self.weight, std=input_size**-0.5)

    def forward(self, inputs, expert_index):
        # inputs (..., input_size), expert_index (...) -> (..., output_size)
        return torch.einsum("...i,...oi->...o", inputs, self.weight[expert_index])


class JetMoeMoA(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.hidden_size = config.kv_channels * config.num_key_value_heads
        self.router = JetMoeTopKGating(config.hidden_size, config.num_local_experts, self.top_k)
        self.input_linear = JetMoeParallelExperts(config.num_local_experts, config.hidden_size, self.hidden_size)
        self.output_linear = JetMoeParallelExperts(config.num_local_experts, self.hidden_size, config.hidden_size)
        self.bias = nn.Parameter(torch.zeros(config.hidden_size))

    def map(self, layer_input):
        # (b, s, hidden) -> (b, s, top_k, kv_projection_size)
        idx, gates = self.router(layer_input)
        self._idx, self._gates = idx, gates
        expanded = layer_input[:, :, None, :].expand(-1, -1, self.top_k, -1)
        return self.input_linear(expanded, idx)

    def reduce(self, layer_input):
        # (b, s, top_k, kv_projection_size) -> (b, s, hidden)
        out = self.output_linear(layer_input, self._idx)
        return (out * self._gates[..., None]).sum(dim=2) + self.bias


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class JetMoeAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_key_value_heads = config.num_key_value_heads
        self.head_dim = config.kv_channels
        self.num_heads = self.top_k * self.num_key_value_heads
        self.kv_projection_size = config.kv_channels * config.num_key_value_heads
        self.experts = JetMoeMoA(config)
        self.kv_proj = nn.Linear(config.hidden_size, self.kv_projection_size * 2, bias=False)
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, hidden_states):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.experts.map(hidden_states)
        key_states, value_states = self.kv_proj(hidden_states).chunk(2, dim=-1)

        query_states = query_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = key_states.view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value_states = value_states.view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)

        t = torch.arange(q_len, dtype=torch.float64)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(hidden_states.dtype), emb.sin().to(hidden_states.dtype)
        query_states = query_states * cos + rotate_half(query_states) * sin
        key_states = key_states * cos + rotate_half(key_states) * sin

        # query heads are expert-major: head e * kv_heads + h uses kv head h
        key_states = key_states.repeat(1, self.top_k, 1, 1)
        value_states = value_states.repeat(1, self.top_k, 1, 1)

        attn_output = nn.functional.scaled_dot_product_attention(
            query_states, key_states, value_states, is_causal=q_len > 1
        )
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, self.top_k, self.kv_projection_size)
        return self.experts.reduce(attn_output)


class JetMoeBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = JetMoeRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attention = JetMoeAttention(config)
        self.post_attention_layernorm = JetMoeRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp_in = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.mlp_out = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden_states):
        hidden_states = hidden_states + self.self_attention(self.input_layernorm(hidden_states))
        gate, up = self.mlp_in(self.post_attention_layernorm(hidden_states)).chunk(2, dim=-1)
        return hidden_states + self.mlp_out(nn.functional.silu(gate) * up)


class JetMoeModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([JetMoeBlock(config)])
        self.norm = JetMoeRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, inputs_embeds):
        h = inputs_embeds
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)


def make_jetmoe_model():
    torch.manual_seed(3211)
    model = JetMoeModel(JetMoeConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, JetMoeRMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {'target': 'make_jetmoe_model',
 'kind': 'causal-multihead',
 'ok': True,
 'layer': 'layers.0.self_attention',
 'unsupported': 'attention_experts',
 'style': 'JetMoE JetMoeAttention MoA (myshell-ai/JetMoE, HF models/jetmoe): refused: Mixture of '
          "Attention heads: each token's query heads (and output projection) come from its top-2 "
          'of 4 routed experts, mixed by the router gates; shared kv_proj'}
