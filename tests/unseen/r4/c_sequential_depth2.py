"""Attention two levels down (layer.mixer.core): qkv in an nn.Sequential named self.w, output self.o, head count only as a literal in rearrange."""

from einops import rearrange
from torch import nn


class Core(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.w = nn.Sequential(nn.Linear(dim, 3 * dim, bias=False), nn.Dropout(0.0))
        self.o = nn.Linear(dim, dim)

    def forward(self, x):
        q, k, v = rearrange(self.w(x), "b n (three h d) -> three b h n d", three=3, h=3)
        scale = q.shape[-1] ** -0.5
        a = (q @ k.transpose(-1, -2) * scale).softmax(dim=-1)
        return self.o(rearrange(a @ v, "b h n d -> b n (h d)"))


class Residual(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.core = Core(dim)

    def forward(self, x):
        return x + self.core(self.norm(x))


class Layer(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.mixer = Residual(dim)
        self.ff = nn.Sequential(
            nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim)
        )

    def forward(self, x):
        x = self.mixer(x)
        return x + self.ff(x)


def make_layer():
    return Layer(18)


EXPECT = {
    "target": "make_layer",
    "kind": "multihead",
    "ok": True,
    "layer": "mixer.core",
    "style": "depth-2 wrapper, nn.Sequential qkv 'w', out 'o', heads literal in rearrange",
}
