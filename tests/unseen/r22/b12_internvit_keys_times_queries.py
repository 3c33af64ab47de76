"""OpenGVLab InternVL vision encoder (InternViT, `InternAttention` naive path): one fused `qkv`
Linear reshaped (B, N, 3, heads, head_dim) and permuted (2, 0, 3, 1, 4), `qk_normalization` with
InternRMSNorm over the full embed width (queries and keys flattened back to (B, N, C) for the norm),
`(q * scale) @ k.transpose(-2, -1)`, softmax, `(attn @ v).transpose(1, 2).reshape(B, N, C)`, `proj`.
Encoder layer with pre-norm and layer-scale `ls1`/`ls2`. Non-causal.

This file: one bug: attn = (k * scale) @ q.transpose(-2, -1)."""

import torch
from torch import nn


class InternVisionConfig:
    hidden_size = 64
    num_attention_heads = 4
    qkv_bias = True
    qk_normalization = True
    layer_norm_eps = 1e-6
    intermediate_size = 128
    initializer_factor = 0.1


class InternRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class InternAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.embed_dim // self.num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(self.embed_dim, 3 * self.embed_dim, bias=config.qkv_bias)
        self.qk_normalization = config.qk_normalization
        if self.qk_normalization:
            self.q_norm = InternRMSNorm(self.embed_dim, eps=config.layer_norm_eps)
            self.k_norm = InternRMSNorm(self.embed_dim, eps=config.layer_norm_eps)
        self.proj = nn.Linear(self.embed_dim, self.embed_dim)

    def _naive_attn(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)

        if self.qk_normalization:
            B_, H_, N_, D_ = q.shape
            q = self.q_norm(q.transpose(1, 2).flatten(-2, -1)).view(B_, N_, H_, D_).transpose(1, 2)
            k = self.k_norm(k.transpose(1, 2).flatten(-2, -1)).view(B_, N_, H_, D_).transpose(1, 2)

        attn = (k * self.scale) @ q.transpose(-2, -1)
        attn = attn.softmax(dim=-1)

        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        return self.proj(x)

    def forward(self, hidden_states):
        return self._naive_attn(hidden_states)


class InternMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x):
        return self.fc2(nn.functional.gelu(self.fc1(x)))


class InternVisionEncoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attn = InternAttention(config)
        self.mlp = InternMLP(config)
        self.norm1 = InternRMSNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.norm2 = InternRMSNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.ls1 = nn.Parameter(config.initializer_factor * torch.ones(config.hidden_size))
        self.ls2 = nn.Parameter(config.initializer_factor * torch.ones(config.hidden_size))

    def forward(self, hidden_states):
        hidden_states = hidden_states + self.attn(self.norm1(hidden_states)) * self.ls1
        return hidden_states + self.mlp(self.norm2(hidden_states)) * self.ls2


class InternVisionEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([InternVisionEncoderLayer(config)])

    def forward(self, inputs_embeds):
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return hidden_states


def make_internvit():
    torch.manual_seed(2218)
    model = InternVisionEncoder(InternVisionConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, InternRMSNorm):
                mod.weight.uniform_(0.5, 1.5)
        for layer in model.layers:
            layer.ls1.uniform_(0.5, 1.5)
            layer.ls2.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {'target': 'make_internvit',
 'kind': 'multihead',
 'ok': False,
 'layer': 'layers.0.attn',
 'stage': 'scores',
 'mistake': 'scores_transposed',
 'style': 'InternViT InternAttention (fused qkv, full-width qk_normalization, naive path): attn = '
          '(k * scale) @ q.transpose(-2, -1)'}
