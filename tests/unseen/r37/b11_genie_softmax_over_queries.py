"""1X GENIE world model (1x-technologies/1xgpt `genie/attention.py`, `genie/st_transformer.py`):
the temporal half of an STBlock, SelfAttention with one fused `qkv` Linear reshaped to (3,
heads, d), per-head LayerNorm q_norm/k_norm (with `qk_norm` the block's own pre-norm becomes
Identity), muP-style attention scale 8 / head_dim when `use_mup` (else head_dim ** -0.5), causal
over time, SDPA or eager core, `proj` out; GELU MLP.

This file: one bug: eager path: attn.softmax(dim=-2): normalised over the query axis"""

import torch
from torch import nn
from torch.nn import functional as F


class GenieConfig:
    d_model = 64
    num_heads = 4
    num_layers = 1
    qkv_bias = False
    proj_bias = True
    qk_norm = True
    use_mup = False
    attn_drop = 0.0
    mlp_ratio = 2.0
    mlp_bias = True
    use_sdpa = False


class SelfAttention(nn.Module):
    def __init__(
        self,
        num_heads,
        d_model,
        qkv_bias=False,
        proj_bias=True,
        qk_norm=True,
        use_mup=True,
        attn_drop=0.0,
        causal=False,
        use_sdpa=True,
    ):
        super().__init__()
        assert d_model % num_heads == 0, "d_model should be divisible by num_heads"
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.qkv = nn.Linear(d_model, d_model * 3, bias=qkv_bias)
        self.proj = nn.Linear(d_model, d_model, bias=proj_bias)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = nn.LayerNorm(self.head_dim, eps=1e-05)
            self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-05)
        self.attn_scale = 8.0 / self.head_dim if use_mup else self.head_dim**-0.5
        self.attn_drop = attn_drop
        self.causal = causal
        self.use_sdpa = use_sdpa

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        if self.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        if self.use_sdpa:
            x = F.scaled_dot_product_attention(
                q, k, v, dropout_p=0.0, is_causal=self.causal, scale=self.attn_scale
            )
        else:
            attn = (q @ k.transpose(-2, -1)) * self.attn_scale
            if self.causal:
                future = torch.triu(torch.ones(N, N, dtype=torch.bool, device=x.device), diagonal=1)
                attn = attn.masked_fill(future, float("-inf"))
            attn = attn.softmax(dim=-2)
            x = attn @ v
        x = x.transpose(1, 2).reshape(B, N, C)
        return self.proj(x)


class Mlp(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden_dim = int(config.d_model * config.mlp_ratio)
        self.fc1 = nn.Linear(config.d_model, hidden_dim, bias=config.mlp_bias)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_dim, config.d_model, bias=config.mlp_bias)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class TemporalBlock(nn.Module):
    """Causal attention over the time axis of one spatial position (STBlock's temporal half)."""

    def __init__(self, config):
        super().__init__()
        self.norm1 = nn.Identity() if config.qk_norm else nn.LayerNorm(config.d_model, eps=1e-05)
        self.attn = SelfAttention(
            config.num_heads,
            config.d_model,
            qkv_bias=config.qkv_bias,
            proj_bias=config.proj_bias,
            qk_norm=config.qk_norm,
            use_mup=config.use_mup,
            attn_drop=config.attn_drop,
            causal=True,
            use_sdpa=config.use_sdpa,
        )
        self.norm2 = nn.LayerNorm(config.d_model, eps=1e-05)
        self.mlp = Mlp(config)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GenieTemporalTransformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.blocks = nn.ModuleList([TemporalBlock(config) for _ in range(config.num_layers)])
        self.out_norm = nn.LayerNorm(config.d_model, eps=1e-05)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.out_norm(x)


def make_genie_model():
    torch.manual_seed(3847)
    model = GenieTemporalTransformer(GenieConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
            elif isinstance(mod, nn.Linear) and mod.bias is not None:
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_genie_model",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "blocks.0.attn",
    "stage": "weights",
    "mistake": "softmax_wrong_dim",
    "style": "1X GENIE SelfAttention (temporal STBlock): one bug: eager path: "
    "attn.softmax(dim=-2): normalised over the query axis",
}
