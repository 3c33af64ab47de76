"""tokasaurus (ScalingIntelligence/tokasaurus, tokasaurus/model/llama.py, qwen3.py) in eager torch.

LlamaForCausalLM: model (LlamaModel: embed_tokens = LlamaEmbeddings(embed_tokens), layers.N =
LlamaBlock(self_attn, mlp)) and lm_head (LlamaLMHead: input_norm RMSNorm, lm_head).  Attention
classes
as in tokasaurus: LlamaAttention (q/k/v/o_proj, no bias), Qwen2Attention (qkv_bias = True),
Qwen3Attention (per-head RMSNorm q_norm / k_norm before the rotation, explicit head_dim).  GQA:
query head h reads kv head h // (heads / kv_heads).  HF rotate_half rotary from position ids,
tables
computed in float64 per call.  tokasaurus_attention writes the new keys/values into a paged
LayerKVCache (k_cache / v_cache of (num_pages, page_size, kv_heads, head_dim), page table handed
out
in scrambled order) and runs a prefill path (q_len > 1, causal mask offset by the cached length)
or a
decode path (q_len == 1, no mask), the two flashinfer wrappers written out in torch.
Cache: book-buffers: `model.reset_kv_cache()`, `model(prompt, use_cache=True)`,
`model(tok, use_cache=True)`; logits tensor of the new rows.  `model(ids)` touches no cache.
Slip: layer 1 is a Qwen3RopeFirstAttention: rotary first, then q_norm / k_norm on the rotated
heads.

"""

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "layer": "model.layers.1.self_attn",
    "stage": "normed_queries",
    "mistake": "qk_norm_misplaced",
    "style": "tokasaurus Qwen3; layer 1 rotates queries and keys first and applies q_norm / "
    "k_norm (non-uniform gains) to the rotated heads",
}


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.eps))


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    # q, k: (b, heads, T, d); cos, sin: (b, T, d)
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class PagedLayerCache:
    """tokasaurus' LayerKVCache: k/v pages (num_pages, page_size, kv_heads, head_dim)."""

    def __init__(self, num_pages, page_size, kv_heads, head_dim, like):
        shape = (num_pages, page_size, kv_heads, head_dim)
        self.k_cache = like.new_zeros(shape)
        self.v_cache = like.new_zeros(shape)


class AttentionInfo(SimpleNamespace):
    """page_table (b, max_pages), page_size, start (tokens already cached)."""

    def slots(self, positions):
        pages = self.page_table[:, positions // self.page_size]
        return pages, positions % self.page_size

    def write(self, layer_cache, k, v):
        # k, v: (b, kv_heads, T, d) for positions start .. start + T - 1
        positions = torch.arange(self.start, self.start + k.shape[2], device=k.device)
        pages, offsets = self.slots(positions)
        layer_cache.k_cache[pages, offsets[None]] = k.transpose(1, 2)
        layer_cache.v_cache[pages, offsets[None]] = v.transpose(1, 2)

    def read(self, layer_cache, length):
        positions = torch.arange(length, device=self.page_table.device)
        pages, offsets = self.slots(positions)
        k = layer_cache.k_cache[pages, offsets[None]].transpose(1, 2)
        v = layer_cache.v_cache[pages, offsets[None]].transpose(1, 2)
        return k, v


def repeat_kv(x, groups):
    # (b, kv_heads, S, d) -> (b, kv_heads * groups, S, d), query head h reads kv head h // groups
    return x.repeat_interleave(groups, dim=1)


def sdpa_with_gqa(q, k, v, mask, expand=repeat_kv):
    groups = q.shape[1] // k.shape[1]
    k, v = expand(k, groups), expand(v, groups)
    scores = torch.matmul(q, k.transpose(-1, -2)) / (q.shape[-1] ** 0.5)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def causal_mask(q_len, kv_len, device):
    # query i (absolute position kv_len - q_len + i) sees keys 0 .. kv_len - q_len + i
    rows = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    cols = torch.arange(kv_len, device=device)[None, :]
    return cols <= rows


def tokasaurus_attention(q, k, v, layer_cache, attn_info, expand=repeat_kv):
    """Prefill (q_len > 1) and decode (q_len == 1) paths, as the two flashinfer wrappers."""
    q_len = q.shape[2]
    if attn_info is None:
        return sdpa_with_gqa(q, k, v, causal_mask(q_len, q_len, q.device), expand)
    if q_len > 1:
        attn_info.write(layer_cache, k, v)
        k_all, v_all = attn_info.read(layer_cache, attn_info.start + q_len)
        mask = causal_mask(q_len, attn_info.start + q_len, q.device)
        return sdpa_with_gqa(q, k_all, v_all, mask, expand)
    attn_info.write(layer_cache, k, v)
    k_all, v_all = attn_info.read(layer_cache, attn_info.start + 1)
    return sdpa_with_gqa(q, k_all, v_all, None, expand)


class LlamaAttention(nn.Module):
    qkv_bias = False
    use_qk_norm = False

    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_attention_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        hd = self.head_dim
        self.q_proj = nn.Linear(
            config.hidden_size, self.num_attention_heads * hd, bias=self.qkv_bias
        )
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * hd, bias=self.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * hd, bias=self.qkv_bias)
        self.o_proj = nn.Linear(self.num_attention_heads * hd, config.hidden_size, bias=False)
        if self.use_qk_norm:
            self.q_norm = RMSNorm(hd, config.rms_norm_eps)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        self.layer_cache = None
        self.attention_info = None

    def norm_and_rotate(self, q, k, cos, sin):
        if self.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary_pos_emb(q, k, cos, sin)

    def attend(self, q, k, v):
        return tokasaurus_attention(q, k, v, self.layer_cache, self.attention_info)

    def forward(self, hidden_states, position_embeddings):
        bsz, q_len, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_attention_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_kv_heads, self.head_dim)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = position_embeddings
        q, k = self.norm_and_rotate(q, k, cos, sin)
        out = self.attend(q, k, v)
        out = out.transpose(1, 2).reshape(bsz, q_len, self.num_attention_heads * self.head_dim)
        return self.o_proj(out)


class Qwen2Attention(LlamaAttention):
    qkv_bias = True


class Qwen3Attention(LlamaAttention):
    use_qk_norm = True


class Qwen3RopeFirstAttention(Qwen3Attention):
    """Qwen3 attention from a port that rotates first and normalizes the rotated heads."""

    def norm_and_rotate(self, q, k, cos, sin):
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return self.q_norm(q), self.k_norm(k)


ATTENTION_CLASSES = {
    "llama": LlamaAttention,
    "qwen2": Qwen2Attention,
    "qwen3": Qwen3Attention,
    "qwen3_rope_first": Qwen3RopeFirstAttention,
}


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        # tokasaurus keeps input_layernorm and the residual inside self_attn / mlp; here the
        # block holds them so that self_attn is the attention alone
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = ATTENTION_CLASSES[config.attn_impl[layer_idx]](config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, hidden_states, position_embeddings):
        h = hidden_states + self.self_attn(self.input_layernorm(hidden_states), position_embeddings)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)

    def forward(self, input_ids):
        return self.embed_tokens(input_ids)


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = LlamaEmbeddings(config)
        self.layers = nn.ModuleList(
            [LlamaBlock(config, i) for i in range(config.num_hidden_layers)]
        )

    def rope(self, position_ids, dtype):
        # rope_cos / rope_sin rows for these positions, computed in float64 and cast
        d = self.config.head_dim
        exponent = torch.arange(0, d, 2, dtype=torch.float64, device=position_ids.device) / d
        inv_freq = 1.0 / (self.config.rope_theta**exponent)
        freqs = position_ids.to(torch.float64)[..., None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, input_ids, position_ids):
        hidden_states = self.embed_tokens(input_ids)
        position_embeddings = self.rope(position_ids, hidden_states.dtype)
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings)
        return hidden_states


class LlamaLMHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, hidden_states):
        return self.lm_head(self.input_norm(hidden_states))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = LlamaLMHead(config)
        self.page_size = 4
        self.reset_kv_cache()

    def reset_kv_cache(self):
        self.page_table = None
        self.seq_len = 0
        for layer in self.model.layers:
            layer.self_attn.layer_cache = None
            layer.self_attn.attention_info = None

    def _setup_pages(self, input_ids, like):
        bsz = input_ids.shape[0]
        max_pages = 64 // self.page_size
        num_pages = bsz * max_pages
        # pages handed out in a scrambled order, as a page allocator would
        gen = torch.Generator().manual_seed(7)
        order = torch.randperm(num_pages, generator=gen).to(input_ids.device)
        self.page_table = order.view(bsz, max_pages)
        c = self.config
        for layer in self.model.layers:
            layer.self_attn.layer_cache = PagedLayerCache(
                num_pages, self.page_size, c.num_key_value_heads, c.head_dim, like
            )

    def forward(self, input_ids, use_cache=False):
        bsz, q_len = input_ids.shape
        start = self.seq_len if use_cache else 0
        position_ids = torch.arange(start, start + q_len, device=input_ids.device)
        position_ids = position_ids[None].expand(bsz, q_len)
        like = self.model.embed_tokens.embed_tokens.weight
        if use_cache and self.page_table is None:
            self._setup_pages(input_ids, like)
        for layer in self.model.layers:
            attn = layer.self_attn
            attn.attention_info = (
                AttentionInfo(page_table=self.page_table, page_size=self.page_size, start=start)
                if use_cache
                else None
            )
        hidden_states = self.model(input_ids, position_ids)
        if use_cache:
            self.seq_len = start + q_len
        for layer in self.model.layers:
            layer.self_attn.attention_info = None
        return self.lm_head(hidden_states)


def make_model():
    torch.manual_seed(3508)
    config = SimpleNamespace(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        attn_impl=["qwen3", "qwen3_rope_first", "qwen3"],
    )
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(35081)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
            elif isinstance(m, nn.Linear) and m.bias is not None:
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()
