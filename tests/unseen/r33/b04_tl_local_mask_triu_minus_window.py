"""TransformerLens-style HookedTransformer block (TransformerLensOrg/TransformerLens,
transformer_lens/components: AbstractAttention, Attention, GroupedQueryAttention). Per-head weight
tensors W_Q [head_index, d_model, d_head], W_O [head_index, d_head, d_model], a precomputed boolean
`mask` buffer (banded for attn_type "local"), rotary tables from calculate_sin_cos_rotary
(rotary_dim, rotary_base, rotary_adjacent_pairs), ALiBi from create_alibi_slope /
create_alibi_multipliers, IGNORE = -inf, softmax with NaN clean-up, pre-norm block with ln1/ln2.

This file: one bug: the local band is torch.triu(causal_mask, -window_size): 7 keys visible for a declared window_size of 6."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class HookedTransformerConfig:
    d_model = 64
    d_mlp = 128
    n_ctx = 128
    n_heads = 4
    d_head = 16
    n_key_value_heads = None
    attention_dir = "causal"
    attn_types = ["local"]
    window_size = 6
    positional_embedding_type = "rotary"
    rotary_dim = 16
    rotary_base = 500000
    rotary_adjacent_pairs = False
    use_attn_scale = True
    eps = 1e-5


class HookPoint(nn.Module):
    """Identity module that marks an activation (hooks are attached by the user)."""

    def forward(self, x):
        return x


class LayerNorm(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.eps = cfg.eps
        self.w = nn.Parameter(torch.ones(cfg.d_model))
        self.b = nn.Parameter(torch.zeros(cfg.d_model))

    def forward(self, x):
        x = x - x.mean(-1, keepdim=True)
        scale = (x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()
        return x / scale * self.w + self.b


def simple_attn_linear(inp, w, b):
    """[batch, pos, d_model] x [head_index, d_model, d_head] -> [batch, pos, head_index, d_head]."""
    n_heads, d_model, d_head = w.shape
    w_flat = w.permute(0, 2, 1).reshape(n_heads * d_head, d_model)
    out = F.linear(inp, w_flat, b.reshape(n_heads * d_head))
    return out.reshape(inp.shape[0], inp.shape[1], n_heads, d_head)


class AbstractAttention(nn.Module):
    def __init__(self, cfg, attn_type="global", layer_id=None):
        super().__init__()
        self.cfg = cfg
        self.W_Q = nn.Parameter(torch.empty(cfg.n_heads, cfg.d_model, cfg.d_head))
        self.b_Q = nn.Parameter(torch.zeros(cfg.n_heads, cfg.d_head))
        self.W_O = nn.Parameter(torch.empty(cfg.n_heads, cfg.d_head, cfg.d_model))
        self.b_O = nn.Parameter(torch.zeros(cfg.d_model))

        self.attn_type = attn_type
        # True where the query (first axis) may attend to the key (second axis)
        causal_mask = torch.tril(torch.ones((cfg.n_ctx, cfg.n_ctx)).bool())
        if self.attn_type == "global":
            self.register_buffer("mask", causal_mask)
        elif self.attn_type == "local":
            # banded: query - window_size < key <= query
            self.register_buffer("mask", torch.triu(causal_mask, -cfg.window_size))
        else:
            raise ValueError(f"Invalid attention type: {self.attn_type}")
        self.register_buffer("IGNORE", torch.tensor(-torch.inf))
        self.layer_id = layer_id

        self.attn_scale = math.sqrt(cfg.d_head) if cfg.use_attn_scale else 1.0

        self.hook_q = HookPoint()
        self.hook_k = HookPoint()
        self.hook_v = HookPoint()
        self.hook_z = HookPoint()
        self.hook_attn_scores = HookPoint()
        self.hook_pattern = HookPoint()

        if cfg.positional_embedding_type == "rotary":
            self.hook_rot_q = HookPoint()
            self.hook_rot_k = HookPoint()
            sin, cos = self.calculate_sin_cos_rotary(cfg.rotary_dim, cfg.n_ctx, base=cfg.rotary_base)
            self.register_buffer("rotary_sin", sin, persistent=False)
            self.register_buffer("rotary_cos", cos, persistent=False)
        elif cfg.positional_embedding_type == "alibi":
            self.alibi = None

    # ---- rotary -------------------------------------------------------------------------------
    def calculate_sin_cos_rotary(self, rotary_dim, n_ctx, base=10000):
        high_precision = torch.float64
        pos = torch.arange(n_ctx, dtype=high_precision)
        dim = torch.arange(rotary_dim // 2, dtype=high_precision)
        freq = base ** (dim / (rotary_dim / 2))
        if self.cfg.rotary_adjacent_pairs:
            freq = freq.repeat_interleave(2)  # (d 2): f0 f0 f1 f1 ...
        else:
            freq = freq.repeat(2)  # (2 d): f0 f1 ... f0 f1 ...
        angles = pos[:, None] / freq[None, :]
        return torch.sin(angles), torch.cos(angles)

    def rotate_every_two(self, x):
        rot_x = x.clone()
        if self.cfg.rotary_adjacent_pairs:
            rot_x[..., ::2] = -x[..., 1::2]
            rot_x[..., 1::2] = x[..., ::2]
        else:
            n = x.size(-1) // 2
            rot_x[..., :n] = -x[..., n:]
            rot_x[..., n:] = x[..., :n]
        return rot_x

    def apply_rotary(self, x, past_kv_pos_offset=0):
        # x: [batch, pos, head_index, d_head]
        x_pos = x.size(1)
        x_rot = x[..., : self.cfg.rotary_dim]
        x_pass = x[..., self.cfg.rotary_dim :]
        x_flip = self.rotate_every_two(x_rot)
        cos = self.rotary_cos[past_kv_pos_offset : past_kv_pos_offset + x_pos, None, :].to(x.dtype)
        sin = self.rotary_sin[past_kv_pos_offset : past_kv_pos_offset + x_pos, None, :].to(x.dtype)
        x_rotated = x_rot * cos + x_flip * sin
        return torch.cat([x_rotated, x_pass], dim=-1)

    # ---- ALiBi --------------------------------------------------------------------------------
    @staticmethod
    def create_alibi_slope(n_ctx, device=None):
        # distance of every key behind its query, as a non-positive lower triangle
        query_pos = torch.arange(n_ctx, device=device).unsqueeze(1)
        key_pos = torch.arange(n_ctx, device=device).unsqueeze(0)
        slope = key_pos - query_pos
        return slope.tril()

    @staticmethod
    def create_alibi_multipliers(n_heads, device=None):
        ratio = 2 ** (-8 / n_heads)
        return ratio ** torch.arange(1, n_heads + 1, dtype=torch.float64, device=device)

    @staticmethod
    def create_alibi_bias(n_heads, n_ctx, device=None):
        slope = AbstractAttention.create_alibi_slope(n_ctx, device)
        multipliers = AbstractAttention.create_alibi_multipliers(n_heads, device)
        return slope[None, :, :] * multipliers[:, None, None]  # [head_index, query_pos, key_pos]

    # ---- core -----------------------------------------------------------------------------------
    def calculate_attention_scores(self, q, k):
        q_ = q.permute(0, 2, 1, 3)  # batch head_index query_pos d_head
        k_ = k.permute(0, 2, 3, 1)  # batch head_index d_head key_pos
        return q_ @ k_ / self.attn_scale

    def calculate_z_scores(self, v, pattern):
        v_ = v.permute(0, 2, 1, 3)  # batch head_index key_pos d_head
        z = pattern @ v_  # batch head_index query_pos d_head
        return z.permute(0, 2, 1, 3)  # batch query_pos head_index d_head

    def apply_causal_mask(self, attn_scores, past_kv_pos_offset=0):
        query_ctx = attn_scores.size(-2)
        key_ctx = attn_scores.size(-1)
        final_mask = self.mask[None, None, -query_ctx:, -key_ctx:]
        return torch.where(final_mask, attn_scores, self.IGNORE.to(attn_scores.dtype))

    def forward(self, query_input, key_input, value_input):
        q, k, v = self.calculate_qkv_matrices(query_input, key_input, value_input)
        kv_cache_pos_offset = 0

        if self.cfg.positional_embedding_type == "rotary":
            q = self.hook_rot_q(self.apply_rotary(q, kv_cache_pos_offset))
            k = self.hook_rot_k(self.apply_rotary(k, 0))

        attn_scores = self.calculate_attention_scores(q, k)

        if self.cfg.positional_embedding_type == "alibi":
            query_ctx = attn_scores.size(-2)
            key_ctx = attn_scores.size(-1)
            if self.alibi is None or key_ctx > self.alibi.size(-1):
                self.alibi = AbstractAttention.create_alibi_bias(
                    self.cfg.n_heads, key_ctx, attn_scores.device
                )
            attn_scores = attn_scores + self.alibi[:, :query_ctx, :key_ctx].to(attn_scores.dtype)

        if self.cfg.attention_dir == "causal":
            attn_scores = self.apply_causal_mask(attn_scores, kv_cache_pos_offset)

        attn_scores = self.hook_attn_scores(attn_scores)
        pattern = F.softmax(attn_scores, dim=-1)
        pattern = torch.where(torch.isnan(pattern), torch.zeros_like(pattern), pattern)
        pattern = self.hook_pattern(pattern)
        z = self.hook_z(self.calculate_z_scores(v, pattern))
        w = self.W_O.reshape(self.cfg.n_heads * self.cfg.d_head, self.cfg.d_model).t()
        return F.linear(z.reshape(z.shape[0], z.shape[1], self.cfg.d_head * self.cfg.n_heads), w, self.b_O)


class Attention(AbstractAttention):
    def __init__(self, cfg, attn_type="global", layer_id=None):
        super().__init__(cfg, attn_type, layer_id)
        self.W_K = nn.Parameter(torch.empty(cfg.n_heads, cfg.d_model, cfg.d_head))
        self.W_V = nn.Parameter(torch.empty(cfg.n_heads, cfg.d_model, cfg.d_head))
        self.b_K = nn.Parameter(torch.zeros(cfg.n_heads, cfg.d_head))
        self.b_V = nn.Parameter(torch.zeros(cfg.n_heads, cfg.d_head))

    def calculate_qkv_matrices(self, query_input, key_input, value_input):
        q = self.hook_q(simple_attn_linear(query_input, self.W_Q, self.b_Q))
        k = self.hook_k(simple_attn_linear(key_input, self.W_K, self.b_K))
        v = self.hook_v(simple_attn_linear(value_input, self.W_V, self.b_V))
        return q, k, v


class GroupedQueryAttention(AbstractAttention):
    """Keys and values have n_key_value_heads heads; each serves n_heads // n_key_value_heads
    consecutive query heads."""

    def __init__(self, cfg, attn_type="global", layer_id=None):
        super().__init__(cfg, attn_type, layer_id)
        self.repeat_kv_heads = cfg.n_heads // cfg.n_key_value_heads
        self._W_K = nn.Parameter(torch.empty(cfg.n_key_value_heads, cfg.d_model, cfg.d_head))
        self._W_V = nn.Parameter(torch.empty(cfg.n_key_value_heads, cfg.d_model, cfg.d_head))
        self._b_K = nn.Parameter(torch.zeros(cfg.n_key_value_heads, cfg.d_head))
        self._b_V = nn.Parameter(torch.zeros(cfg.n_key_value_heads, cfg.d_head))

    def calculate_qkv_matrices(self, query_input, key_input, value_input):
        q = self.hook_q(simple_attn_linear(query_input, self.W_Q, self.b_Q))
        k = self.hook_k(simple_attn_linear(key_input, self._W_K, self._b_K))
        v = self.hook_v(simple_attn_linear(value_input, self._W_V, self._b_V))
        return q, k, v

    def calculate_attention_scores(self, q, k):
        k = torch.repeat_interleave(k, dim=2, repeats=self.repeat_kv_heads)
        return super().calculate_attention_scores(q, k)

    def calculate_z_scores(self, v, pattern):
        v = torch.repeat_interleave(v, dim=2, repeats=self.repeat_kv_heads)
        return super().calculate_z_scores(v, pattern)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.W_in = nn.Parameter(torch.empty(cfg.d_model, cfg.d_mlp))
        self.b_in = nn.Parameter(torch.zeros(cfg.d_mlp))
        self.W_out = nn.Parameter(torch.empty(cfg.d_mlp, cfg.d_model))
        self.b_out = nn.Parameter(torch.zeros(cfg.d_model))

    def forward(self, x):
        return F.gelu(x @ self.W_in + self.b_in) @ self.W_out + self.b_out


class TransformerBlock(nn.Module):
    def __init__(self, cfg, block_index):
        super().__init__()
        self.ln1 = LayerNorm(cfg)
        self.ln2 = LayerNorm(cfg)
        attn_type = cfg.attn_types[block_index]
        if cfg.n_key_value_heads is not None:
            self.attn = GroupedQueryAttention(cfg, attn_type, block_index)
        else:
            self.attn = Attention(cfg, attn_type, block_index)
        self.mlp = MLP(cfg)
        self.hook_resid_pre = HookPoint()

    def forward(self, resid_pre):
        resid_pre = self.hook_resid_pre(resid_pre)
        normalized = self.ln1(resid_pre)
        resid_mid = resid_pre + self.attn(normalized, normalized, normalized)
        return resid_mid + self.mlp(self.ln2(resid_mid))


class HookedTransformer(nn.Module):
    """Residual-stream trunk (embeddings are passed in directly)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList([TransformerBlock(cfg, i) for i in range(len(cfg.attn_types))])
        self.ln_final = LayerNorm(cfg)

    def forward(self, residual):
        for block in self.blocks:
            residual = block(residual)
        return self.ln_final(residual)


def make_hooked_transformer():
    torch.manual_seed(3391)
    model = HookedTransformer(HookedTransformerConfig())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".w"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".b") or "b_" in name.split(".")[-1]:
                p.uniform_(-0.2, 0.2)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-2]))
    return model.eval()


EXPECT = {'target': 'make_hooked_transformer',
 'kind': 'causal-multihead',
 'ok': False,
 'layer': 'blocks.0.attn',
 'stage': 'masked_scores',
 'mistake': 'window_size',
 'style': 'TransformerLens HookedTransformer Attention (TransformerLensOrg/TransformerLens '
          'transformer_lens/components): one bug: the local band is torch.triu(causal_mask, '
          '-window_size): 7 keys visible for a declared window_size of 6'}
