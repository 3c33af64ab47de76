"""A small ALiBi decoder written against attention-gym's mods (pytorch-labs/attention-gym).

attention-gym expresses attention variants as FlexAttention callables: a `score_mod(score, b, h, q_idx,
kv_idx)` (here `generate_alibi_bias(H)` from attn_gym/mods/alibi.py: score + (kv_idx - q_idx) *
exp2(-(h + 1) * 8 / H)) and a `mask_mod(b, h, q_idx, kv_idx)` (`causal_mask`: q_idx >= kv_idx).
`flex_attention` is replaced by a plain-torch stand-in that evaluates both mods on broadcast index
tensors over the dense score matrix (what flex's math reference does), -inf for masked pairs.
For decoding the model keeps FlexAttention-style static buffers per attention (`k_cache`, `v_cache`,
(max_batch 4, H, 64, D)), writes the new keys at `input_pos`, attends over all 64 slots and shifts
both mods by the query offset (`q_idx + offset`), the way flex decoding is usually wired.
Tree: decoder.tok_emb, decoder.blocks.N (ln_1, attn [Wqkv, out_proj], ln_2, mlp), decoder.ln_f,
lm_head.  LayerNorm pre-norm, MHA 4 heads, no position embedding besides ALiBi, 3 blocks.
Cache: book-buffers: `model.reset_kv_cache()`, `model(prompt, use_cache=True)`, `model(tok,
use_cache=True)`; `model(ids)` touches no cache; returns the logits tensor.
Slip: block 2 was built with an older copy of the ALiBi mod (`generate_alibi_bias_v0`, kept for a
non-causal visualisation) whose bias is (q_idx - kv_idx) * slope: under the causal mask every key
behind the query gets a bonus that grows with distance.  The slopes are right.  Cached decoding shifts
the same mod by the offset, so it still equals this model's own full pass.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,  # the writer had True beside the slip it states; corrected after the first run
    "layers": [
        "decoder.blocks.0.attn",
        "decoder.blocks.1.attn",
        "decoder.blocks.2.attn",
    ],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "layer": "decoder.blocks.2.attn",
    "stage": "biased_scores",
    "mistake": "bias_sign",
    "style": "attention-gym score_mod/mask_mod: generate_alibi_bias(H) + causal_mask evaluated densely by a "
    "flex_attention stand-in, fused Wqkv, static k_cache/v_cache buffers written at input_pos, mods "
    "shifted by the query offset on decode; ALiBi only, MHA 4 heads; block 2 "
    "uses generate_alibi_bias_v0 with (q_idx - kv_idx) * slope",
}


def generate_alibi_bias(H):
    def alibi_mod(score, b, h, q_idx, kv_idx):
        scale = torch.exp2(-((h + 1) * 8.0 / H))
        bias = (kv_idx - q_idx) * scale
        return score + bias

    return alibi_mod


def generate_alibi_bias_v0(H):
    def alibi_mod(score, b, h, q_idx, kv_idx):
        scale = torch.exp2(-((h + 1) * 8.0 / H))
        bias = (q_idx - kv_idx) * scale
        return score + bias

    return alibi_mod


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def offset_mod(mod, offset, is_mask):
    if is_mask:

        def shifted(b, h, q_idx, kv_idx):
            return mod(b, h, q_idx + offset, kv_idx)
    else:

        def shifted(score, b, h, q_idx, kv_idx):
            return mod(score, b, h, q_idx + offset, kv_idx)

    return shifted


def flex_attention(query, key, value, score_mod=None, mask_mod=None, scale=None):
    B, H, L, E = query.shape
    S = key.shape[-2]
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    dev = query.device
    b = torch.arange(B, device=dev).view(B, 1, 1, 1)
    h = torch.arange(H, device=dev, dtype=query.dtype).view(1, H, 1, 1)
    q_idx = torch.arange(L, device=dev).view(1, 1, L, 1)
    kv_idx = torch.arange(S, device=dev).view(1, 1, 1, S)
    if score_mod is not None:
        scores = score_mod(scores, b, h, q_idx, kv_idx)
    if mask_mod is not None:
        keep = mask_mod(b, h, q_idx, kv_idx)
        scores = scores.masked_fill(~keep, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return torch.matmul(weights, value)


class CausalSelfAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.d_model // config.n_head
        self.d_model = config.d_model
        self.Wqkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.out_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        alibi_fn = (
            generate_alibi_bias_v0
            if layer_idx in config.legacy_alibi_layers
            else generate_alibi_bias
        )
        self.score_mod = alibi_fn(config.n_head)
        self.mask_mod = causal_mask
        self.k_cache = None
        self.v_cache = None

    def setup_cache(self, max_batch, max_seq, dtype, device):
        shape = (max_batch, self.n_head, max_seq, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)

    def forward(self, x, input_pos=None):
        B, T, C = x.shape
        q, k, v = self.Wqkv(x).split(self.d_model, dim=-1)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        if input_pos is None:
            y = flex_attention(q, k, v, score_mod=self.score_mod, mask_mod=self.mask_mod)
        else:
            if self.k_cache.dtype != x.dtype:
                self.k_cache = self.k_cache.to(x.dtype)
                self.v_cache = self.v_cache.to(x.dtype)
            self.k_cache[:B, :, input_pos] = k
            self.v_cache[:B, :, input_pos] = v
            offset = int(input_pos[0])
            y = flex_attention(
                q,
                self.k_cache[:B],
                self.v_cache[:B],
                score_mod=offset_mod(self.score_mod, offset, is_mask=False),
                mask_mod=offset_mod(self.mask_mod, offset, is_mask=True),
            )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.out_proj(y)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc1 = nn.Linear(config.d_model, 4 * config.d_model)
        self.fc2 = nn.Linear(4 * config.d_model, config.d_model)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x, input_pos=None):
        x = x + self.attn(self.ln_1(x), input_pos)
        return x + self.mlp(self.ln_2(x))


class Decoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList([Block(config, i) for i in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.d_model)

    def forward(self, idx, input_pos=None):
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = block(x, input_pos)
        return self.ln_f(x)


class AlibiLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.decoder = Decoder(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.cache_pos = None

    def reset_kv_cache(self):
        w = self.lm_head.weight
        for block in self.decoder.blocks:
            block.attn.setup_cache(4, self.config.max_seq_len, w.dtype, w.device)
        self.cache_pos = 0

    def forward(self, idx, use_cache=False):
        input_pos = None
        if use_cache:
            if self.cache_pos is None:
                self.reset_kv_cache()
            T = idx.shape[1]
            input_pos = torch.arange(self.cache_pos, self.cache_pos + T, device=idx.device)
            self.cache_pos += T
        return self.lm_head(self.decoder(idx, input_pos))


def make_model():
    torch.manual_seed(2406)
    config = SimpleNamespace(
        vocab_size=96, d_model=64, n_head=4, n_layer=3, max_seq_len=64, legacy_alibi_layers=(2,)
    )
    model = AlibiLM(config)
    g = torch.Generator().manual_seed(24061)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()
