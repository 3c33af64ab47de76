"""Salesforce CTRL in the shape of transformers' modeling_ctrl.py (written from memory, in my own
words): token embedding `transformer.w` multiplied by sqrt(d_model), a fixed sinusoidal position
table (angles pos / 10000^(2i/d), sin block then cos block), pre-LayerNorm blocks
`transformer.h.N` with `multi_head_attention` (Wq, Wk, Wv, dense, all with bias), the functional
`scaled_dot_product_attention(q, k, v, mask)` helper that divides by sqrt(dk) and adds
`mask * -1e4` (CTRL's own fill), `ffn` as an nn.Sequential (0: Linear, 1: ReLU, 2: Linear),
final `transformer.layernorm`, `lm_head` with bias.  4 heads of 16, 3 layers.

Layer 2 is built with `use_fused_qk=True`, which routes it through a variant helper that forms the
score matrix as k @ q^T.  No cache.

Slip: `transformer.h.2.multi_head_attention` computes keys times queries (stage `scores`,
`scores_transposed`).
"""

import numpy as np
import torch
import torch.nn as nn

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "transformer.h.0.multi_head_attention",
        "transformer.h.1.multi_head_attention",
        "transformer.h.2.multi_head_attention",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "transformer.h.2.multi_head_attention",
    "stage": "scores",
    "mistake": "scores_transposed",
    "style": "modeling_ctrl.py: embedding * sqrt(d), sinusoidal table, Wq/Wk/Wv/dense, mask * -1e4, ffn Sequential; "
    "slip: layer 2's fused-qk helper computes k @ q^T",
}


class CTRLConfig:
    vocab_size = 170
    n_positions = 64
    n_embd = 64
    dff = 128
    n_layer = 3
    n_head = 4
    layer_norm_epsilon = 1e-6
    fused_qk_layers = [2]


def angle_defn(pos, i, d_model_size):
    return pos * (1 / torch.pow(10000, (2 * (i // 2)) / d_model_size))


def positional_encoding(position, d_model_size):
    angle_rads = angle_defn(
        torch.arange(position, dtype=torch.float64).unsqueeze(1),
        torch.arange(d_model_size, dtype=torch.float64).unsqueeze(0),
        d_model_size,
    )
    sines = torch.sin(angle_rads[:, 0::2])
    cosines = torch.cos(angle_rads[:, 1::2])
    return torch.cat([sines, cosines], dim=-1).float()


def scaled_dot_product_attention(q, k, v, mask):
    matmul_qk = torch.matmul(q, k.permute(0, 1, 3, 2))
    dk = k.shape[-1]
    scaled_attention_logits = matmul_qk / np.sqrt(dk)
    if mask is not None:
        nd, ns = scaled_attention_logits.size(-2), scaled_attention_logits.size(-1)
        scaled_attention_logits = scaled_attention_logits + mask[ns - nd : ns, :ns] * -1e4
    attention_weights = torch.softmax(scaled_attention_logits, dim=-1)
    return torch.matmul(attention_weights, v), attention_weights


def fused_qk_attention(q, k, v, mask):
    matmul_qk = torch.matmul(k, q.transpose(-1, -2))
    scaled_attention_logits = matmul_qk / np.sqrt(k.shape[-1])
    if mask is not None:
        nd, ns = scaled_attention_logits.size(-2), scaled_attention_logits.size(-1)
        scaled_attention_logits = scaled_attention_logits + mask[ns - nd : ns, :ns] * -1e4
    attention_weights = torch.softmax(scaled_attention_logits, dim=-1)
    return torch.matmul(attention_weights, v), attention_weights


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model_size, num_heads, use_fused_qk=False):
        super().__init__()
        self.num_heads = num_heads
        self.d_model_size = d_model_size
        self.depth = int(d_model_size / self.num_heads)
        self.Wq = nn.Linear(d_model_size, d_model_size)
        self.Wk = nn.Linear(d_model_size, d_model_size)
        self.Wv = nn.Linear(d_model_size, d_model_size)
        self.dense = nn.Linear(d_model_size, d_model_size)
        self.attend = fused_qk_attention if use_fused_qk else scaled_dot_product_attention

    def split_into_heads(self, x, batch_size):
        x = x.reshape(batch_size, -1, self.num_heads, self.depth)
        return x.permute([0, 2, 1, 3])

    def forward(self, v, k, q, mask):
        batch_size = q.shape[0]
        q = self.split_into_heads(self.Wq(q), batch_size)
        k = self.split_into_heads(self.Wk(k), batch_size)
        v = self.split_into_heads(self.Wv(v), batch_size)
        scaled_attention, attn = self.attend(q, k, v, mask)
        scaled_attention = scaled_attention.permute([0, 2, 1, 3])
        original_size_attention = scaled_attention.reshape(batch_size, -1, self.d_model_size)
        return self.dense(original_size_attention), attn


def point_wise_feed_forward_network(d_model_size, dff):
    return nn.Sequential(nn.Linear(d_model_size, dff), nn.ReLU(), nn.Linear(dff, d_model_size))


class EncoderLayer(nn.Module):
    def __init__(self, d_model_size, num_heads, dff, eps, use_fused_qk=False):
        super().__init__()
        self.multi_head_attention = MultiHeadAttention(d_model_size, num_heads, use_fused_qk)
        self.ffn = point_wise_feed_forward_network(d_model_size, dff)
        self.layernorm1 = nn.LayerNorm(d_model_size, eps=eps)
        self.layernorm2 = nn.LayerNorm(d_model_size, eps=eps)

    def forward(self, x, mask):
        normed = self.layernorm1(x)
        attn_output, _ = self.multi_head_attention(normed, normed, normed, mask)
        out1 = x + attn_output
        return out1 + self.ffn(self.layernorm2(out1))


class CTRLModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.d_model_size = config.n_embd
        self.register_buffer(
            "pos_encoding",
            positional_encoding(config.n_positions, self.d_model_size),
            persistent=False,
        )
        self.w = nn.Embedding(config.vocab_size, config.n_embd)
        self.h = nn.ModuleList(
            [
                EncoderLayer(
                    config.n_embd,
                    config.n_head,
                    config.dff,
                    config.layer_norm_epsilon,
                    use_fused_qk=i in config.fused_qk_layers,
                )
                for i in range(config.n_layer)
            ]
        )
        self.layernorm = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    def forward(self, input_ids):
        seq_len = input_ids.shape[-1]
        inputs_embeds = self.w(input_ids)
        mask = torch.triu(torch.ones(seq_len, seq_len, dtype=inputs_embeds.dtype), 1)
        inputs_embeds = inputs_embeds * np.sqrt(self.d_model_size)
        pos_embeds = self.pos_encoding[:seq_len, :].to(inputs_embeds.dtype)
        hidden_states = inputs_embeds + pos_embeds
        for h in self.h:
            hidden_states = h(hidden_states, mask)
        return self.layernorm(hidden_states)


class CTRLLMHeadModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transformer = CTRLModel(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=True)

    def forward(self, input_ids):
        return self.lm_head(self.transformer(input_ids))


def make_model():
    torch.manual_seed(6010)
    model = CTRLLMHeadModel(CTRLConfig())
    with torch.no_grad():
        model.transformer.w.weight.mul_(0.12)
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
                m.bias.copy_(0.1 * torch.randn_like(m.bias))
    return model.eval()
