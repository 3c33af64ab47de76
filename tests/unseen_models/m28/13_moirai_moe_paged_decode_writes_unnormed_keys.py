"""Moirai-MoE-like decoder (uni2ts attention conventions), multi-query attention, paged cache.

MoiraiMoEDecoder: in_proj embedding, decoder.layers.N (norm1 -> self_attn -> + x, norm2 -> GLU ffn
-> + x), decoder.norm, param_proj. MultiQueryAttention: q_proj (64 -> 64), k_proj / v_proj (64 ->
16: one kv head, MQA 4/1), full-width LayerNorm q_norm (over all 64 query features, before the head
split) and k_norm, partial rotary on the first half of each head (8 of 16 features) in interleaved
pairs, base 1e4, bool causal mask on positions, masked_fill -inf.

Cache (book-cache): `cache = mod.KVCache(n_layers=3)` (= PagedKVCache, block_size 4, 64 blocks),
`model(prompt, cache=cache)`, then `model(tok, cache=cache)`; each call reserves blocks per batch
row from a free list, writes rotated keys and values into per-layer (blocks, 4, 1, 16) pools
through the block table and gathers the row's blocks back in table order. Returns logits.

Slip: 3 layers; write_normed_keys_on_decode False: on decode calls the pools receive the rotated
key before k_norm (left from a kernel that normed on read), and attention reads them back from the
pool. The prompt's keys are right; each decoded token's own key (and later its cached key) is
un-normed. Full forward and prompt pass exact.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "decoder.layers.0.self_attn",
        "decoder.layers.1.self_attn",
        "decoder.layers.2.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "decode": {"mistake": "cache_other", "step": 0, "layer": "decoder.layers.0.self_attn"},
    "style": "Moirai-MoE-like as 04 with 3 layers; decode writes the un-normed (rotated) "
    "key into the paged pool",
}


class RMSNorm(nn.Module):
    def __init__(self, normalized_shape, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(normalized_shape))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class PagedKVCache:
    """Block-paged key/value pools: per layer (num_blocks, block_size, kv_heads, head_dim) pools
    in the activations' dtype, one block table per batch row, blocks handed out from a free list."""

    def __init__(self, n_layers, block_size=4, num_blocks=64):
        self.n_layers = n_layers
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.k_pools = [None] * n_layers
        self.v_pools = [None] * n_layers
        self.block_tables = None
        self.free_blocks = list(range(num_blocks))
        self.seq_len = 0

    def get_seq_length(self):
        return self.seq_len

    def reserve(self, batch, new_len):
        if self.block_tables is None:
            self.block_tables = [[] for _ in range(batch)]
        need = -(-new_len // self.block_size)
        for table in self.block_tables:
            while len(table) < need:
                if not self.free_blocks:
                    raise ValueError("PagedKVCache is out of blocks")
                table.append(self.free_blocks.pop(0))

    def _slots(self, positions, device):
        tables = torch.tensor(self.block_tables, device=device)
        blocks = tables[:, positions // self.block_size]
        return blocks, (positions % self.block_size)[None].expand_as(blocks)

    def write(self, layer, k, v, positions):
        if self.k_pools[layer] is None:
            shape = (self.num_blocks, self.block_size) + tuple(k.shape[2:])
            self.k_pools[layer] = torch.zeros(shape, dtype=k.dtype, device=k.device)
            self.v_pools[layer] = torch.zeros(shape, dtype=v.dtype, device=v.device)
        blocks, offs = self._slots(positions, k.device)
        self.k_pools[layer][blocks, offs] = k
        self.v_pools[layer][blocks, offs] = v

    def gather(self, layer, length, device):
        blocks, offs = self._slots(torch.arange(length, device=device), device)
        return self.k_pools[layer][blocks, offs], self.v_pools[layer][blocks, offs]


class PartialRotaryProjection(nn.Module):
    """Interleaved-pair rotary on the first `rotary_dim` features of each head (rest pass)."""

    def __init__(self, head_dim, fraction=0.5, base=10000.0):
        super().__init__()
        self.rotary_dim = int(head_dim * fraction)
        self.base = base

    def forward(self, x, seq_id):
        rd = self.rotary_dim
        theta = 1.0 / (
            self.base ** (torch.arange(0, rd, 2, dtype=torch.float64, device=x.device) / rd)
        )
        m_theta = (seq_id.to(torch.float64)[:, None] * theta).repeat_interleave(2, dim=-1)
        cos = m_theta.cos().to(x.dtype)[:, None, :]  # x is (b, s, heads, head_dim)
        sin = m_theta.sin().to(x.dtype)[:, None, :]
        x_rot, x_pass = x[..., :rd], x[..., rd:]
        pairs = x_rot.unflatten(-1, (-1, 2))
        turned = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)
        return torch.cat([x_rot * cos + turned * sin, x_pass], dim=-1)


class MultiQueryAttention(nn.Module):
    """uni2ts GroupedQueryAttention with num_groups=1 (MQA) and full-width LayerNorm q/k norms."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.dim = config.d_model
        self.num_heads = config.num_heads
        self.head_dim = self.dim // self.num_heads
        self.q_proj = nn.Linear(self.dim, self.dim, bias=False)
        self.k_proj = nn.Linear(self.dim, self.head_dim, bias=False)
        self.v_proj = nn.Linear(self.dim, self.head_dim, bias=False)
        self.q_norm = nn.LayerNorm(self.dim)
        self.k_norm = nn.LayerNorm(self.head_dim)
        self.rotary = PartialRotaryProjection(
            self.head_dim, config.rotary_fraction, config.rope_base
        )
        self.out_proj = nn.Linear(self.dim, self.dim, bias=False)
        self.write_normed_keys_on_decode = config.write_normed_keys_on_decode

    def forward(self, x, time_id, cache=None):
        b, s, _ = x.shape
        query = self.q_norm(self.q_proj(x)).view(b, s, self.num_heads, self.head_dim)
        key_raw = self.k_proj(x).view(b, s, 1, self.head_dim)
        value = self.v_proj(x).view(b, s, 1, self.head_dim)
        query = self.rotary(query, time_id)
        key = self.rotary(self.k_norm(key_raw), time_id)
        q_pos = time_id
        if cache is not None:
            decoding = cache.get_seq_length() > 0
            to_write = key
            if decoding and not self.write_normed_keys_on_decode:
                to_write = self.rotary(key_raw, time_id)
            cache.write(self.layer_idx, to_write, value, time_id)
            key, value = cache.gather(self.layer_idx, int(time_id[-1]) + 1, x.device)
        k_pos = torch.arange(key.shape[1], device=x.device)
        q = query.transpose(1, 2)
        k = key.transpose(1, 2)
        v = value.transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        allowed = k_pos[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
        out = torch.matmul(F.softmax(scores, dim=-1), v)
        return self.out_proj(out.transpose(1, 2).reshape(b, s, self.dim))


class GatedLinearUnitFeedForward(nn.Module):
    def __init__(self, in_dim, hidden_dim):
        super().__init__()
        self.fc1 = nn.Linear(in_dim, hidden_dim, bias=False)
        self.fc_gate = nn.Linear(in_dim, hidden_dim, bias=False)
        self.fc2 = nn.Linear(hidden_dim, in_dim, bias=False)

    def forward(self, x):
        return self.fc2(F.silu(self.fc_gate(x)) * self.fc1(x))


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.norm1 = RMSNorm(config.d_model)
        self.self_attn = MultiQueryAttention(config, layer_idx)
        self.norm2 = RMSNorm(config.d_model)
        self.ffn = GatedLinearUnitFeedForward(config.d_model, config.d_ff)

    def forward(self, x, time_id, cache=None):
        x = x + self.self_attn(self.norm1(x), time_id, cache)
        return x + self.ffn(self.norm2(x))


class MoiraiMoEDecoder(nn.Module):
    """Decoder-only Moirai-MoE-like stack (dense FFN here) with a paged book cache."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.in_proj = nn.Embedding(config.vocab_size, config.d_model)
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList(
            [DecoderLayer(config, i) for i in range(config.num_layers)]
        )
        self.decoder.norm = RMSNorm(config.d_model)
        self.param_proj = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def reset_kv_cache(self):
        pass

    def forward(self, input_ids, cache=None):
        b, s = input_ids.shape
        start = cache.get_seq_length() if cache is not None else 0
        time_id = torch.arange(start, start + s, device=input_ids.device)
        if cache is not None:
            cache.reserve(b, start + s)
        x = self.in_proj(input_ids)
        for layer in self.decoder.layers:
            x = layer(x, time_id, cache)
        if cache is not None:
            cache.seq_len = start + s
        return self.param_proj(self.decoder.norm(x))


KVCache = PagedKVCache


def make_model():
    torch.manual_seed(2813)
    config = SimpleNamespace(
        vocab_size=96,
        d_model=64,
        d_ff=128,
        num_heads=4,
        rope_base=10000.0,
        rotary_fraction=0.5,
        num_layers=3,
        write_normed_keys_on_decode=False,
    )
    model = MoiraiMoEDecoder(config)
    g = torch.Generator().manual_seed(28131)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (RMSNorm, nn.LayerNorm)):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
            if isinstance(m, nn.LayerNorm):
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()
