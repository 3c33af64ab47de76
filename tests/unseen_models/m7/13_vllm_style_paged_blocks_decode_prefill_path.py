"""A vLLM-style Llama (vllm/model_executor/models/llama.py) over a paged key/value cache, in torch.

model.embed_tokens, model.layers.N (input_layernorm, self_attn, post_attention_layernorm, mlp with
gate_up_proj + SiluAndMul + down_proj), model.norm, lm_head.  LlamaAttention: fused qkv_proj split
by sizes [q | k | v], GQA 4/2, rotary_emb (neox style = halves, base 10000) applied from
positions, attn = an Attention wrapper (owns no weights) that writes keys/values into the paged
cache through slot_mapping and then runs either the prefill path (causal attention over the tokens
of this call) or the decode path (gathers each sequence's blocks through block_tables up to
context_lens), o_proj.  KVCache(n_layers) holds the block pool (num_blocks, block_size, kv, hd) per
layer, a block table per sequence (block_size 4, blocks handed out in order) and seq_lens.
Slip: AttentionMetadata decides is_prompt with `query_lens <= seq_lens_after` (always true), so a
one-token step runs the prefill path: the new token attends only to itself, although its key and
value were written to the cache and its position is right.
book-cache: cache = mod.KVCache(n_layers=3); model(prompt, cache=cache); model(tok, cache=cache).
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "decode": {"mistake": "cache_mask", "step": 0, "layer": "model.layers.0.self_attn"},
    "style": "vLLM llama.py in torch: fused qkv_proj/gate_up_proj, neox rotary from positions, Attention wrapper over a "
    "paged block cache (slot_mapping, block_tables, context_lens), GQA 4/2; slip: is_prompt always true, so decode "
    "steps take the prefill path and see only themselves",
}


class LlamaConfig:
    vocab_size = 120
    hidden_size = 64
    intermediate_size = 128
    num_hidden_layers = 3
    num_attention_heads = 4
    num_key_value_heads = 2
    rope_theta = 10000.0
    rms_norm_eps = 1e-6
    block_size = 4
    num_blocks = 64


class KVCache:
    def __init__(self, n_layers, num_blocks=64, block_size=4):
        self.n_layers = n_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.key_blocks = [None] * n_layers
        self.value_blocks = [None] * n_layers
        self.block_tables = None
        self.seq_lens = None
        self.next_free = 0

    def reset(self):
        self.__init__(self.n_layers, self.num_blocks, self.block_size)

    def allocate(self, batch, new_len, device):
        if self.seq_lens is None:
            self.seq_lens = torch.zeros(batch, dtype=torch.long, device=device)
            self.block_tables = [[] for _ in range(batch)]
        for i in range(batch):
            need = (int(self.seq_lens[i]) + new_len + self.block_size - 1) // self.block_size
            while len(self.block_tables[i]) < need:
                self.block_tables[i].append(self.next_free)
                self.next_free += 1

    def pools(self, layer, kv_heads, head_dim, dtype, device):
        if self.key_blocks[layer] is None or self.key_blocks[layer].dtype != dtype:
            shape = (self.num_blocks, self.block_size, kv_heads, head_dim)
            self.key_blocks[layer] = torch.zeros(shape, dtype=dtype, device=device)
            self.value_blocks[layer] = torch.zeros(shape, dtype=dtype, device=device)
        return self.key_blocks[layer], self.value_blocks[layer]


@dataclass
class AttentionMetadata:
    is_prompt: bool
    slot_mapping: torch.Tensor  # (batch, q_len) flat slot ids
    block_tables: list
    context_lens: torch.Tensor  # (batch,) tokens visible after this call
    cache: KVCache


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(variance + self.variance_epsilon) * self.weight


class RotaryEmbedding(nn.Module):
    def __init__(self, head_size, rotary_dim, max_position_embeddings, base, is_neox_style=True):
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (
            base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
        )
        t = torch.arange(max_position_embeddings, dtype=torch.float64)
        freqs = torch.einsum("i,j->ij", t, inv_freq)
        self.register_buffer(
            "cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1).float(), persistent=False
        )

    def forward(self, positions, query, key):
        # query/key: (batch, len, heads, head_size)
        cos_sin = self.cos_sin_cache[positions].to(query.dtype)
        cos, sin = cos_sin.chunk(2, dim=-1)
        cos = cos[:, :, None, :]
        sin = sin[:, :, None, :]

        def rot(x):
            x1, x2 = torch.chunk(x, 2, dim=-1)
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

        return rot(query), rot(key)


class Attention(nn.Module):
    def __init__(self, num_heads, head_size, scale, num_kv_heads, layer_idx):
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.layer_idx = layer_idx

    def _sdpa(self, q, k, v, causal):
        # q: (b, lq, h, d); k/v: (b, lk, kv, d)
        rep = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * self.scale
        if causal is not None:
            scores = scores.masked_fill(~causal, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.einsum("bhqk,bkhd->bqhd", probs, v)

    def forward(self, q, k, v, attn_metadata=None):
        b, lq = q.shape[:2]
        q = q.view(b, lq, self.num_heads, self.head_size)
        k = k.view(b, lq, self.num_kv_heads, self.head_size)
        v = v.view(b, lq, self.num_kv_heads, self.head_size)
        if attn_metadata is not None:
            cache = attn_metadata.cache
            key_pool, value_pool = cache.pools(
                self.layer_idx, self.num_kv_heads, self.head_size, k.dtype, k.device
            )
            bs = cache.block_size
            flat_k = key_pool.view(-1, self.num_kv_heads, self.head_size)
            flat_v = value_pool.view(-1, self.num_kv_heads, self.head_size)
            flat_k[attn_metadata.slot_mapping.reshape(-1)] = k.reshape(
                -1, self.num_kv_heads, self.head_size
            )
            flat_v[attn_metadata.slot_mapping.reshape(-1)] = v.reshape(
                -1, self.num_kv_heads, self.head_size
            )
        if attn_metadata is None or attn_metadata.is_prompt:
            causal = torch.ones(lq, lq, dtype=torch.bool, device=q.device).tril()
            out = self._sdpa(q, k, v, causal)
        else:
            outs = []
            for i in range(b):
                n = int(attn_metadata.context_lens[i])
                table = torch.tensor(
                    attn_metadata.block_tables[i], dtype=torch.long, device=q.device
                )
                slots = (table[:, None] * bs + torch.arange(bs, device=q.device)[None, :]).reshape(
                    -1
                )[:n]
                ki = flat_k[slots][None]
                vi = flat_v[slots][None]
                q_pos = torch.arange(n - lq, n, device=q.device)[:, None]
                k_pos = torch.arange(n, device=q.device)[None, :]
                outs.append(self._sdpa(q[i : i + 1], ki, vi, k_pos <= q_pos))
            out = torch.cat(outs, dim=0)
        return out.reshape(b, lq, self.num_heads * self.head_size)


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.rotary_emb = RotaryEmbedding(
            self.head_dim, self.head_dim, 64, config.rope_theta, is_neox_style=True
        )
        self.attn = Attention(
            self.num_heads, self.head_dim, self.scaling, self.num_kv_heads, layer_idx
        )

    def forward(self, positions, hidden_states, attn_metadata=None):
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        b, l, _ = q.shape
        q, k = self.rotary_emb(
            positions,
            q.view(b, l, self.num_heads, self.head_dim),
            k.view(b, l, self.num_kv_heads, self.head_dim),
        )
        attn_output = self.attn(q.reshape(b, l, -1), k.reshape(b, l, -1), v, attn_metadata)
        return self.o_proj(attn_output)


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions, hidden_states, attn_metadata):
        residual = hidden_states
        hidden_states = self.self_attn(
            positions=positions,
            hidden_states=self.input_layernorm(hidden_states),
            attn_metadata=attn_metadata,
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, positions, attn_metadata):
        hidden_states = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states, attn_metadata)
        return self.norm(hidden_states)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def reset_kv_cache(self):
        pass

    def forward(self, input_ids, cache=None):
        b, l = input_ids.shape
        if cache is None:
            positions = torch.arange(l, device=input_ids.device)[None].expand(b, -1)
            attn_metadata = None
        else:
            cache.allocate(b, l, input_ids.device)
            start = cache.seq_lens.clone()
            positions = start[:, None] + torch.arange(l, device=input_ids.device)[None]
            seq_lens_after = start + l
            query_lens = torch.full_like(start, l)
            bs = cache.block_size
            tables = torch.tensor(cache.block_tables, dtype=torch.long, device=input_ids.device)
            slot_mapping = tables.gather(1, positions // bs) * bs + positions % bs
            is_prompt = bool((query_lens <= seq_lens_after).all())
            attn_metadata = AttentionMetadata(
                is_prompt=is_prompt,
                slot_mapping=slot_mapping,
                block_tables=cache.block_tables,
                context_lens=seq_lens_after,
                cache=cache,
            )
        hidden = self.model(input_ids, positions, attn_metadata)
        if cache is not None:
            cache.seq_lens = cache.seq_lens + l
        return self.lm_head(hidden)


def make_model():
    torch.manual_seed(713)
    model = LlamaForCausalLM(LlamaConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, 0.1)
            elif isinstance(m, nn.Embedding):
                m.weight.normal_(0.0, 0.5)
            elif isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
    return model.eval()
