"""MetaFormer-style net: blocks in a ModuleDict/Sequential, attention under `token_mixer`, head count only in a config, dict output."""

from dataclasses import dataclass

import torch.nn.functional as F
from torch import nn


@dataclass
class MixerConfig:
    dim: int = 20
    num_heads: int = 4
    depth: int = 1
    mlp_ratio: int = 2


class SelfAttentionMixer(nn.Module):
    def __init__(self, cfg: MixerConfig):
        super().__init__()
        self.cfg = cfg
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).view(B, N, 3, self.cfg.num_heads, -1)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        out = out.transpose(1, 2).reshape(B, N, C)
        return {"hidden_states": self.proj(out), "aux_loss": x.new_zeros(())}


class MetaBlock(nn.Module):
    def __init__(self, cfg: MixerConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.token_mixer = SelfAttentionMixer(cfg)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim),
            nn.GELU(),
            nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim),
        )

    def forward(self, x):
        x = x + self.token_mixer(self.norm1(x))["hidden_states"]
        return x + self.mlp(self.norm2(x))


class MetaNet(nn.Module):
    def __init__(self, cfg: MixerConfig):
        super().__init__()
        self.stages = nn.ModuleDict(
            {
                "stem": nn.Identity(),
                "body": nn.Sequential(*[MetaBlock(cfg) for _ in range(cfg.depth)]),
            }
        )

    def forward(self, x):
        return self.stages["body"](self.stages["stem"](x))


def make_net():
    return MetaNet(MixerConfig())


EXPECT = {
    "target": "make_net",
    "kind": "multihead",
    "ok": True,
    "layer": "stages.body.0.token_mixer",
    "style": "MetaFormer-like: ModuleDict of stages, Sequential of blocks, attention as `token_mixer`, heads only in a config, SDPA",
}
