"""Boltz (jwohlwend/boltz, boltz/model/layers/attention.py AttentionPairBias inside a pairformer
layer): single representation s attended with a per-head bias projected from the pair
representation z (proj_z = LayerNorm(c_z) + Linear(c_z, num_heads), rearranged "b i j h -> b h i j"),
einsum "bihd,bjhd->bhij" / sqrt(head_dim) + z, softmax, einsum "bhij,bjhd->bihd", the output gated by
sigmoid(proj_g(s)) before proj_o. Here the pair representation is initialised from s the way the
trunk input embedder does (outer sum of two projections plus a clipped relative-position one-hot).

This file: refused: the score bias is a learned function of the pair representation z (itself built
from the tokens: outer sum + relative-position encoding), not a fixed position bias, and the output
is sigmoid-gated per channel."""

import torch
import torch.nn.functional as F
from torch import nn


class AttentionPairBias(nn.Module):
    def __init__(self, c_s, c_z, num_heads, inf=1e6, initial_norm=True):
        super().__init__()
        assert c_s % num_heads == 0
        self.c_s = c_s
        self.num_heads = num_heads
        self.head_dim = c_s // num_heads
        self.inf = inf
        self.initial_norm = initial_norm
        if self.initial_norm:
            self.norm_s = nn.LayerNorm(c_s)
        self.proj_q = nn.Linear(c_s, c_s)
        self.proj_k = nn.Linear(c_s, c_s, bias=False)
        self.proj_v = nn.Linear(c_s, c_s, bias=False)
        self.proj_g = nn.Linear(c_s, c_s, bias=False)
        self.proj_z_norm = nn.LayerNorm(c_z)
        self.proj_z_linear = nn.Linear(c_z, num_heads, bias=False)
        self.proj_o = nn.Linear(c_s, c_s, bias=False)

    def forward(self, s, z, mask):
        B = s.shape[0]
        if self.initial_norm:
            s = self.norm_s(s)
        q = self.proj_q(s).view(B, -1, self.num_heads, self.head_dim)
        k = self.proj_k(s).view(B, -1, self.num_heads, self.head_dim)
        v = self.proj_v(s).view(B, -1, self.num_heads, self.head_dim)
        bias = self.proj_z_linear(self.proj_z_norm(z)).permute(0, 3, 1, 2)  # b h i j
        g = self.proj_g(s).sigmoid()

        attn = torch.einsum("bihd,bjhd->bhij", q, k)
        attn = attn / (self.head_dim**0.5) + bias
        attn = attn + (1 - mask[:, None, None].to(attn.dtype)) * -self.inf
        attn = attn.softmax(dim=-1)
        o = torch.einsum("bhij,bjhd->bihd", attn, v)
        o = o.reshape(B, -1, self.c_s)
        return self.proj_o(g * o)


class Transition(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden, bias=False)
        self.fc2 = nn.Linear(dim, hidden, bias=False)
        self.fc3 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        x = self.norm(x)
        return self.fc3(F.silu(self.fc1(x)) * self.fc2(x))


class PairformerLayer(nn.Module):
    def __init__(self, token_s, token_z, num_heads):
        super().__init__()
        self.attention = AttentionPairBias(token_s, token_z, num_heads)
        self.transition_s = Transition(token_s, token_s * 2)

    def forward(self, s, z, mask):
        s = s + self.attention(s, z, mask)
        return s + self.transition_s(s)


class RelativePositionEncoder(nn.Module):
    def __init__(self, token_z, r_max=8):
        super().__init__()
        self.r_max = r_max
        self.linear_layer = nn.Linear(2 * r_max + 2, token_z, bias=False)

    def forward(self, n, dtype, device):
        idx = torch.arange(n, device=device)
        d = torch.clip(idx[None, :] - idx[:, None] + self.r_max, 0, 2 * self.r_max)
        rel = F.one_hot(d, 2 * self.r_max + 2).to(dtype)
        return self.linear_layer(rel)  # (n, n, token_z)


class BoltzTrunkLite(nn.Module):
    def __init__(self, token_s=64, token_z=16, num_heads=4, num_blocks=1):
        super().__init__()
        self.z_init_1 = nn.Linear(token_s, token_z, bias=False)
        self.z_init_2 = nn.Linear(token_s, token_z, bias=False)
        self.rel_pos = RelativePositionEncoder(token_z)
        self.pairformer = nn.Module()
        self.pairformer.layers = nn.ModuleList(
            [PairformerLayer(token_s, token_z, num_heads) for _ in range(num_blocks)]
        )
        self.s_norm = nn.LayerNorm(token_s)

    def forward(self, s_inputs):
        B, N, _ = s_inputs.shape
        z = self.z_init_1(s_inputs)[:, :, None] + self.z_init_2(s_inputs)[:, None, :]
        z = z + self.rel_pos(N, s_inputs.dtype, s_inputs.device)[None]
        mask = torch.ones(B, N, dtype=s_inputs.dtype, device=s_inputs.device)
        s = s_inputs
        for layer in self.pairformer.layers:
            s = layer(s, z, mask)
        return self.s_norm(s)


def make_boltz_pairformer():
    torch.manual_seed(3701)
    model = BoltzTrunkLite()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_boltz_pairformer",
    "kind": "multihead",
    "ok": True,
    "layer": "pairformer.layers.0.attention",
    "unsupported": "pair_bias",
    "style": "Boltz AttentionPairBias (jwohlwend/boltz boltz/model/layers/attention.py): refused: per-head "
    "score bias projected from the pair representation z (outer sum of s projections + relative-position "
    "one-hot), sigmoid output gate proj_g; 4 heads of 16, bidirectional",
}
