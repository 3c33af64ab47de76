"""GPT-Neo style local attention layer (attention_types ['local'], window_size 8):
q/k/v projections without bias, out_proj with bias, causal bias buffer XOR'ed with
its band below -window_size, and, as in the original GPT-Neo design, no division of
the scores by sqrt(head_dim).
"""

import torch
from torch import nn


class GPTNeoSelfAttention(nn.Module):
    def __init__(
        self, embed_dim=64, num_heads=4, attention_type="local", window_size=8, max_positions=128
    ):
        super().__init__()
        bias = torch.tril(torch.ones((max_positions, max_positions), dtype=torch.bool)).view(
            1, 1, max_positions, max_positions
        )
        if attention_type == "local":
            bias = torch.bitwise_xor(bias, torch.tril(bias, -window_size))
        self.register_buffer("bias", bias, persistent=False)
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=True)

    def _split_heads(self, t):
        return t.view(t.size()[:-1] + (self.num_heads, self.head_dim)).permute(0, 2, 1, 3)

    def _attn(self, query, key, value):
        # GPT-Neo keeps the scores unscaled (no division by sqrt(head_dim))
        attn_weights = torch.matmul(query, key.transpose(-1, -2))
        q_len, k_len = query.size(-2), key.size(-2)
        causal_mask = self.bias[:, :, k_len - q_len : k_len, :k_len]
        mask_value = torch.tensor(torch.finfo(attn_weights.dtype).min, dtype=attn_weights.dtype)
        attn_weights = torch.where(causal_mask, attn_weights, mask_value)
        attn_weights = nn.functional.softmax(attn_weights, dim=-1).to(value.dtype)
        return torch.matmul(attn_weights, value)

    def forward(self, hidden_states):
        q = self._split_heads(self.q_proj(hidden_states))
        k = self._split_heads(self.k_proj(hidden_states))
        v = self._split_heads(self.v_proj(hidden_states))
        out = self._attn(q, k, v).permute(0, 2, 1, 3).contiguous()
        out = out.view(out.size()[:-2] + (self.embed_dim,))
        return self.out_proj(out)


class GPTNeoBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(64)
        self.attn = nn.Module()
        self.attn.attention = GPTNeoSelfAttention()

    def forward(self, hidden_states):
        return hidden_states + self.attn.attention(self.ln_1(hidden_states))


def make_gptneo_block():
    torch.manual_seed(115)
    blk = GPTNeoBlock()
    with torch.no_grad():
        blk.ln_1.weight.uniform_(0.5, 1.5)
    return blk


EXPECT = {
    "target": "make_gptneo_block",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "attn.attention",
    "stage": "scaled_scores",
    "mistake": "missing_scale",
    "style": "HF GPT-Neo local layer (window_size 8 via bitwise_xor band, finfo.min fill): no 1/sqrt(head_dim) "
    "scale, GPT-Neo's design; the vocabulary reports it as missing_scale",
}
