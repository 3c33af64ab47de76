"""OpenAI GPT (GPT-1) after transformers' modeling_openai.py (small, random weights, no cache).

OpenAIGPTLMHeadModel: transformer (OpenAIGPTModel: tokens_embed, positions_embed (learned absolute),
h.N) and a tied lm_head.  Block is post-norm: attn -> ln_1(x + a) -> mlp (c_fc, gelu, c_proj) ->
ln_2(n + m).  Attention: Conv1D c_attn (weight laid out (in, out)) split into query/key/value,
split_heads with keys permuted to (b, h, d, s), scores / sqrt(head_dim) (scale=True), the
`bias` tril buffer applied as `w * b + -1e4 * (1 - b)`, softmax, merge_heads, Conv1D c_proj.
Slip: layer 2 uses `OpenAIGPTPackedAttention`, which cuts the fused projection into three pieces
with the slice offsets (0, n, n): its values are the key slice of c_attn (made with the keys'
weights).  Queries and keys are right.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "transformer.h.0.attn",
        "transformer.h.1.attn",
        "transformer.h.2.attn",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "transformer.h.2.attn",
    "stage": "values",
    "mistake": "wrong_projection",
    "style": "modeling_openai.py GPT-1: tokens_embed/positions_embed, post-norm ln_1/ln_2, Conv1D c_attn/c_proj, keys "
    "split as (b, h, d, s), w*b - 1e4*(1-b) mask; layer 2 takes its values from the key slice of c_attn",
}


class Conv1D(nn.Module):
    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.08)
        self.bias = nn.Parameter(torch.randn(nf) * 0.05)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class Attention(nn.Module):
    slice_offsets = (0, 1, 2)

    def __init__(self, nx, n_positions, config, scale=False):
        super().__init__()
        self.register_buffer(
            "bias", torch.tril(torch.ones(n_positions, n_positions)).view(1, 1, n_positions, n_positions),
            persistent=False,
        )
        self.n_head = config.n_head
        self.split_size = nx
        self.scale = scale
        self.c_attn = Conv1D(nx * 3, nx)
        self.c_proj = Conv1D(nx, nx)

    def _attn(self, q, k, v):
        w = torch.matmul(q, k)
        if self.scale:
            w = w / math.sqrt(v.size(-1))
        b = self.bias[:, :, : w.size(-2), : w.size(-1)]
        w = w * b + -1e4 * (1 - b)
        w = nn.functional.softmax(w, dim=-1)
        return torch.matmul(w, v)

    def merge_heads(self, x):
        x = x.permute(0, 2, 1, 3).contiguous()
        return x.view(*x.size()[:-2], x.size(-2) * x.size(-1))

    def split_heads(self, x, k=False):
        x = x.view(*x.size()[:-1], self.n_head, x.size(-1) // self.n_head)
        return x.permute(0, 2, 3, 1) if k else x.permute(0, 2, 1, 3)

    def forward(self, x):
        x = self.c_attn(x)
        n = self.split_size
        query, key, value = (x[..., o * n : (o + 1) * n] for o in self.slice_offsets)
        query = self.split_heads(query)
        key = self.split_heads(key, k=True)
        value = self.split_heads(value)
        a = self._attn(query, key, value)
        a = self.merge_heads(a)
        return (self.c_proj(a),)


class OpenAIGPTPackedAttention(Attention):
    slice_offsets = (0, 1, 1)


class MLP(nn.Module):
    def __init__(self, n_state, config):
        super().__init__()
        self.c_fc = Conv1D(n_state, config.n_embd)
        self.c_proj = Conv1D(config.n_embd, n_state)

    def forward(self, x):
        return self.c_proj(nn.functional.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_positions, config, packed=False):
        super().__init__()
        nx = config.n_embd
        self.attn = (OpenAIGPTPackedAttention if packed else Attention)(nx, n_positions, config, scale=True)
        self.ln_1 = nn.LayerNorm(nx, eps=config.layer_norm_epsilon)
        self.mlp = MLP(4 * nx, config)
        self.ln_2 = nn.LayerNorm(nx, eps=config.layer_norm_epsilon)

    def forward(self, x):
        a = self.attn(x)[0]
        n = self.ln_1(x + a)
        return self.ln_2(n + self.mlp(n))


class OpenAIGPTModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.tokens_embed = nn.Embedding(config.vocab_size, config.n_embd)
        self.positions_embed = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList([Block(config.n_positions, config, packed=(i == config.packed_layer))
                                for i in range(config.n_layer)])
        self.register_buffer("position_ids", torch.arange(config.n_positions), persistent=False)

    def forward(self, input_ids):
        position_ids = self.position_ids[None, : input_ids.size(-1)]
        hidden_states = self.tokens_embed(input_ids) + self.positions_embed(position_ids)
        for block in self.h:
            hidden_states = block(hidden_states)
        return hidden_states


class OpenAIGPTLMHeadModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transformer = OpenAIGPTModel(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.tokens_embed.weight

    def forward(self, input_ids):
        return SimpleNamespace(logits=self.lm_head(self.transformer(input_ids)))


def make_model():
    torch.manual_seed(909)
    config = SimpleNamespace(vocab_size=128, n_positions=64, n_embd=64, n_layer=3, n_head=4,
                             layer_norm_epsilon=1e-5, packed_layer=2)
    model = OpenAIGPTLMHeadModel(config)
    g = torch.Generator().manual_seed(9091)
    with torch.no_grad():
        model.transformer.tokens_embed.weight.normal_(0.0, 0.5, generator=g)
        model.transformer.positions_embed.weight.normal_(0.0, 0.5, generator=g)
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()
