"""StepFun Step1 (Step-Audio's Step1ForCausalLM, modeling_step1.py) in the manner of its
serving-engine ports.

Step1ForCausalLM: model (Step1Model: embed_tokens, layers.N, norm) and lm_head.  StepLayer:
input_layernorm -> self_attn -> residual, post_attention_layernorm -> SwiGLU mlp -> residual.
StepAttention: q_proj, k_proj and v_proj for num_attention_groups kv heads (MQA 4/1),
repeat_interleave to the query heads, scores * 1/sqrt(d), then Step1's square-root ALiBi:
bias[h, i, j] = -slope[h] * sqrt(i - j) with the standard geometric slopes (2^-2 .. 2^-8 for 4
heads), -inf above the diagonal; no position embedding; o_proj. Slip: alibi_distance_sign is
(-1, +1, -1, -1): layer 1 adds +slope * sqrt(i - j) (a checkpoint-conversion setting), a bias
that favours distant keys.  Decoding agrees with its own full pass. Cache: book-cache: `cache =
mod.KVCache(n_layers=N)`, `model(prompt, cache=cache)`, `model(tok, cache=cache)`; returns the
logits tensor.  Paged: per layer 64 blocks of 4 slots (block, slot, kv, d), each batch row owns
a block table filled from a free list (blocks handed out from the top, interleaved across rows);
new keys are written first, a call with a past gathers the blocks, a prompt call attends its own
keys.  64 positions at most; the batch may not change.  `model.reset_kv_cache()` is a no-op.
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
        "model.layers.0.self_attn",
        "model.layers.1.self_attn",
        "model.layers.2.self_attn",
        "model.layers.3.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "layer": "model.layers.1.self_attn",
    "stage": "biased_scores",
    "mistake": "bias_sign",
    "style": "Step1 as 03 with MQA 4/1 and 4 layers; layer 1's square-root ALiBi has the "
    "wrong sign (+slope * sqrt(distance))",
}


class StepRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.eps) * self.weight


def alibi_slopes(n_heads):
    n = 2 ** math.floor(math.log2(n_heads))
    m0 = 2.0 ** (-8.0 / n)
    slopes = torch.pow(m0, torch.arange(1, n + 1, dtype=torch.float64))
    if n < n_heads:
        m1 = 2.0 ** (-4.0 / n)
        mm = torch.pow(m1, torch.arange(1, 1 + 2 * (n_heads - n), 2, dtype=torch.float64))
        slopes = torch.cat([slopes, mm])
    return slopes


def build_alibi_bias(q_pos, k_pos, n_heads, dtype, distance_sign=-1.0):
    """Step1's square-root ALiBi: bias[h, i, j] = -slope[h] * sqrt(i - j) for j <= i, -inf above."""
    slopes = alibi_slopes(n_heads)
    dist = (q_pos[:, None] - k_pos[None, :]).to(torch.float64)
    bias = distance_sign * torch.sqrt(dist.clamp(min=0.0)) * slopes[:, None, None]
    bias = bias.masked_fill(dist < 0, float("-inf"))
    return bias.to(dtype)


class KVCache:
    """A paged key/value pool in the manner of a serving engine's block manager.

    Per layer, pools of `num_blocks` blocks of `block_size` slots, shaped (num_blocks, block_size,
    kv_heads, head_dim); each batch row owns a block table filled from a free list on demand.
    Layers are keyed 0..n_layers-1."""

    def __init__(self, n_layers, max_sequence_length=64, block_size=4, num_blocks=64):
        self.n_layers = n_layers
        self.max_sequence_length = max_sequence_length
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.k_pools = None
        self.v_pools = None
        self.block_tables = None
        self.seq_len = 0
        self.batch_size = None

    def get_seq_length(self):
        return self.seq_len

    def _allocate(self, batch_size, kv_heads, head_dim, dtype, device):
        shape = (self.num_blocks, self.block_size, kv_heads, head_dim)
        self.k_pools = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.n_layers)
        ]
        self.v_pools = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.n_layers)
        ]
        # hand blocks out from the top of the pool, interleaved between rows
        self.free_blocks = list(range(self.num_blocks))
        self.block_tables = [[] for _ in range(batch_size)]
        self.batch_size = batch_size

    def begin(self, batch_size, num_new, kv_heads, head_dim, dtype, device):
        if self.k_pools is None:
            self._allocate(batch_size, kv_heads, head_dim, dtype, device)
        if batch_size != self.batch_size:
            raise ValueError("batch size changed within one cache")
        total = self.seq_len + num_new
        if total > self.max_sequence_length:
            raise ValueError("sequence longer than the cache")
        needed = -(-total // self.block_size)
        for table in self.block_tables:
            while len(table) < needed:
                table.append(self.free_blocks.pop())
        return torch.arange(self.seq_len, total, device=device)

    def end(self, num_new):
        self.seq_len += num_new

    def write(self, layer_idx, positions, key, value):
        # key/value: (b, s, kv_heads, d)
        for b, table in enumerate(self.block_tables):
            for i, pos in enumerate(positions.tolist()):
                block = table[pos // self.block_size]
                self.k_pools[layer_idx][block, pos % self.block_size] = key[b, i]
                self.v_pools[layer_idx][block, pos % self.block_size] = value[b, i]

    def gather(self, layer_idx, length):
        keys, values = [], []
        for table in self.block_tables:
            idx = torch.tensor(table, dtype=torch.long)
            k = self.k_pools[layer_idx][idx].flatten(0, 1)[:length]
            v = self.v_pools[layer_idx][idx].flatten(0, 1)[:length]
            keys.append(k)
            values.append(v)
        return torch.stack(keys), torch.stack(values)


class StepAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_groups = config.num_attention_groups
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_groups * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_groups * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.distance_sign = config.alibi_distance_sign[layer_idx]

    def forward(self, x, positions, cache=None):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.num_groups, self.head_dim)
        v = self.v_proj(x).view(b, s, self.num_groups, self.head_dim)
        k_pos = positions
        if cache is not None:
            cache.write(self.layer_idx, positions, k, v)
            kv_len = int(positions[-1]) + 1
            k_pos = torch.arange(kv_len, device=x.device)
            if s < kv_len:
                k, v = cache.gather(self.layer_idx, kv_len)
        rep = self.num_heads // self.num_groups
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(self.head_dim))
        scores = (
            scores
            + build_alibi_bias(positions, k_pos, self.num_heads, scores.dtype, self.distance_sign)[
                None
            ]
        )
        probs = F.softmax(scores, dim=-1)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim)
        return self.o_proj(out)


class StepMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class StepLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = StepAttention(config, layer_idx)
        self.mlp = StepMLP(config)
        self.input_layernorm = StepRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = StepRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, positions, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), positions, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Step1Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([StepLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = StepRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, cache=None):
        b, s = input_ids.shape
        h = self.embed_tokens(input_ids)
        if cache is not None:
            cfg = self.config
            head_dim = cfg.hidden_size // cfg.num_attention_heads
            positions = cache.begin(b, s, cfg.num_attention_groups, head_dim, h.dtype, h.device)
        else:
            positions = torch.arange(s, device=input_ids.device)
        for layer in self.layers:
            h = layer(h, positions, cache)
        if cache is not None:
            cache.end(s)
        return self.norm(h)


class Step1ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = Step1Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def reset_kv_cache(self):
        pass

    def forward(self, input_ids, cache=None):
        return self.lm_head(self.model(input_ids, cache=cache))


def make_model():
    torch.manual_seed(3007)
    config = SimpleNamespace(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=144,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_attention_groups=1,
        rms_norm_eps=1e-5,
        alibi_distance_sign=(-1.0, 1.0, -1.0, -1.0),
    )
    model = Step1ForCausalLM(config)
    g = torch.Generator().manual_seed(30071)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, StepRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()
