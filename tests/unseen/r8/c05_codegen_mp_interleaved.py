"""CodeGen style attention: one qkv_proj whose output is cut into mp_num=4 model-parallel
chunks, each chunk holding [query | value | key] slices (CodeGen's odd order), sinusoidal
table from create_sinusoidal_positions, rotate_every_two (adjacent pairs) on the first
rotary_dim=8 features of each 16-wide head, scores divided by sqrt(head_dim).
"""

import torch
from torch import nn


def create_sinusoidal_positions(num_pos, dim):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    sinusoid = torch.einsum("i,j->ij", torch.arange(num_pos, dtype=torch.float64), inv_freq)
    return torch.cat((torch.sin(sinusoid), torch.cos(sinusoid)), dim=1)


def rotate_every_two(x):
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary_pos_emb(t, sin, cos):
    sin = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
    cos = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
    return t * cos + rotate_every_two(t) * sin


class CodeGenAttention(nn.Module):
    def __init__(self, embed_dim=64, num_heads=4, rotary_dim=8, max_positions=128):
        super().__init__()
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.rotary_dim = rotary_dim
        self.mp_num = 4
        self.qkv_proj = nn.Linear(embed_dim, 3 * embed_dim, bias=False)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.register_buffer(
            "embed_positions",
            create_sinusoidal_positions(max_positions, rotary_dim).float(),
            persistent=False,
        )
        self.scale_attn = self.head_dim**0.5

    def _split_heads(self, x, n_head, dim_head, mp_num):
        reshaped = x.reshape(x.shape[:-1] + (n_head // mp_num, dim_head))
        return reshaped.reshape(x.shape[:-2] + (-1,) + reshaped.shape[-1:])

    def forward(self, hidden_states, position_ids, causal_mask):
        qkv = self.qkv_proj(hidden_states)
        qkv_split = qkv.reshape(qkv.shape[:-1] + (self.mp_num, -1))
        local_dim = self.head_dim * self.num_heads // self.mp_num
        query, value, key = torch.split(qkv_split, local_dim, dim=-1)
        query = self._split_heads(query, self.num_heads, self.head_dim, self.mp_num)
        key = self._split_heads(key, self.num_heads, self.head_dim, self.mp_num)
        value = self._split_heads(value, self.num_heads, self.head_dim, self.mp_num).permute(
            0, 2, 1, 3
        )
        sincos = self.embed_positions[position_ids].to(hidden_states.dtype)
        sin, cos = torch.split(sincos, sincos.shape[-1] // 2, dim=-1)
        k_rot, k_pass = key[..., : self.rotary_dim], key[..., self.rotary_dim :]
        q_rot, q_pass = query[..., : self.rotary_dim], query[..., self.rotary_dim :]
        key = torch.cat([apply_rotary_pos_emb(k_rot, sin, cos), k_pass], dim=-1).permute(0, 2, 1, 3)
        query = torch.cat([apply_rotary_pos_emb(q_rot, sin, cos), q_pass], dim=-1).permute(
            0, 2, 1, 3
        )
        w = torch.matmul(query, key.transpose(-1, -2)) / self.scale_attn
        w = torch.where(causal_mask, w, torch.tensor(torch.finfo(w.dtype).min, dtype=w.dtype))
        w = nn.functional.softmax(w, dim=-1)
        out = torch.matmul(w, value).permute(0, 2, 1, 3).contiguous()
        out = out.view(out.shape[:-2] + (self.num_heads * self.head_dim,))
        return self.out_proj(out)


class CodeGenBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(64)
        self.attn = CodeGenAttention()
        self.mlp = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))

    def forward(self, hidden_states):
        b, t, _ = hidden_states.shape
        position_ids = torch.arange(t, dtype=torch.long).unsqueeze(0).view(-1, t).expand(b, t)
        causal = torch.tril(torch.ones(t, t, dtype=torch.bool)).view(1, 1, t, t)
        h = self.ln_1(hidden_states)
        return hidden_states + self.attn(h, position_ids, causal) + self.mlp(h)


def make_codegen():
    torch.manual_seed(5)
    blk = CodeGenBlock()
    with torch.no_grad():
        blk.ln_1.weight.uniform_(0.5, 1.5)
    return blk


EXPECT = {
    "target": "make_codegen",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "attn",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "interleaved", "fraction": 0.5, "base": 10000},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "HF CodeGen: fused qkv_proj in mp_num=4 chunks ordered (query, value, key), rotate_every_two with "
    "repeat_interleaved sin/cos on rotary_dim 8 of head_dim 16, parallel GPT-J-like block",
}
