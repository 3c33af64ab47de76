"""A masked-LM encoder in the shape of nomic-ai's `NomicBertForPreTraining` (remote code
modeling_hf_nomic_bert.py, written from memory, in my own words): `bert.embeddings`
(word_embeddings + token_type_embeddings, no absolute positions), `bert.emb_ln`, `bert.encoder.layers.N`
blocks that are *post-norm* (`norm1(dropout(attn) + x)`, `norm2(dropout(mlp) + x)`), attention
`NomicBertAttention` with one bias-free `Wqkv` rearranged "... (three h d) -> ... three h d",
a flash-attn-style `rotary_emb` (non-interleaved = halves, rotary_emb_fraction 1.0, base 1000),
heads gathered with `permute(0, 3, 2, 1, 4).unbind(dim=2)`, scores divided by `norm_factor`
= sqrt(head_dim), an additive extended attention mask (all zeros for these unpadded inputs),
`out_proj`; `NomciBertGatedMLP` (the repository's spelling) with fc11/fc12/fc2 SwiGLU; `cls.predictions` head
(dense, gelu, LayerNorm, decoder tied to the word embeddings).  Bidirectional: no causal mask.
4 heads of 16, d 64, 2 layers, vocab 110.  No cache.  Returns an object with `.logits`.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["bert.encoder.layers.0.attn", "bert.encoder.layers.1.attn"],
    "kind": "multihead",
    "cache": None,
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": False,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 1.0, "base": 1000.0},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "nomic-bert modeling_hf_nomic_bert.py: bias-free Wqkv (three h d), rotary halves base 1000, "
    "permute(0, 3, 2, 1, 4).unbind(2), norm_factor, post-norm blocks, SwiGLU fc11/fc12/fc2, tied MLM decoder",
}


class NomicBertConfig:
    vocab_size = 110
    type_vocab_size = 2
    n_embd = 64
    n_head = 4
    n_layer = 2
    n_inner = 128
    rotary_emb_fraction = 1.0
    rotary_emb_base = 1000.0
    rotary_emb_interleaved = False
    layer_norm_epsilon = 1e-12
    qkv_proj_bias = False
    mlp_fc1_bias = False
    mlp_fc2_bias = False


class MaskedLMOutput:
    def __init__(self, logits):
        self.logits = logits


def rotate_half(x, interleaved=False):
    if not interleaved:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary_emb(x, cos, sin, interleaved=False):
    ro_dim = cos.shape[-1] * 2
    if interleaved:
        cos = cos.repeat_interleave(2, dim=-1)[:, None]
        sin = sin.repeat_interleave(2, dim=-1)[:, None]
    else:
        cos = torch.cat([cos, cos], dim=-1)[:, None]
        sin = torch.cat([sin, sin], dim=-1)[:, None]
    return torch.cat(
        [x[..., :ro_dim] * cos + rotate_half(x[..., :ro_dim], interleaved) * sin, x[..., ro_dim:]],
        dim=-1,
    )


class NomicBertRotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0, interleaved=False):
        super().__init__()
        self.dim = dim
        self.interleaved = interleaved
        self.register_buffer(
            "inv_freq",
            1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)),
            persistent=False,
        )

    def forward(self, qkv, seqlen_offset=0):
        seqlen = qkv.shape[1]
        t = torch.arange(seqlen_offset, seqlen_offset + seqlen, dtype=torch.float64)
        freqs = torch.outer(t, self.inv_freq)
        cos, sin = freqs.cos().to(qkv.dtype), freqs.sin().to(qkv.dtype)
        q = apply_rotary_emb(qkv[:, :, 0], cos, sin, self.interleaved)
        k = apply_rotary_emb(qkv[:, :, 1], cos, sin, self.interleaved)
        return torch.stack((q, k, qkv[:, :, 2]), dim=2)


class NomicBertEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.n_embd)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.n_embd)

    def forward(self, input_ids, token_type_ids=None):
        embeddings = self.word_embeddings(input_ids)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        return embeddings + self.token_type_embeddings(token_type_ids)


class NomicBertAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_dim = config.n_embd
        self.num_heads = config.n_head
        self.head_dim = self.embed_dim // self.num_heads
        self.rotary_emb_dim = int(self.head_dim * config.rotary_emb_fraction)
        self.Wqkv = nn.Linear(self.embed_dim, 3 * self.embed_dim, bias=config.qkv_proj_bias)
        self.out_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=config.qkv_proj_bias)
        self.rotary_emb = NomicBertRotaryEmbedding(
            self.rotary_emb_dim,
            base=config.rotary_emb_base,
            interleaved=config.rotary_emb_interleaved,
        )
        self.norm_factor = math.sqrt(self.head_dim)
        self.drop = nn.Dropout(0.0)

    def forward(self, hidden_states, attention_mask=None):
        qkv = self.Wqkv(hidden_states)
        b, s, _ = qkv.shape
        qkv = qkv.view(b, s, 3, self.num_heads, self.head_dim)
        if self.rotary_emb_dim > 0:
            qkv = self.rotary_emb(qkv)
        query, key, value = qkv.permute(0, 3, 2, 1, 4).unbind(dim=2)  # each (b, h, s, d)
        attention_scores = torch.matmul(query, key.transpose(-1, -2)) / self.norm_factor
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask
        attentions_probs = F.softmax(attention_scores, dim=-1)
        attentions_probs = self.drop(attentions_probs)
        attn_output = torch.matmul(attentions_probs, value)
        attn_output = attn_output.permute(0, 2, 1, 3).reshape(b, s, self.embed_dim)
        return self.out_proj(attn_output)


class NomciBertGatedMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc11 = nn.Linear(config.n_embd, config.n_inner, bias=config.mlp_fc1_bias)
        self.fc12 = nn.Linear(config.n_embd, config.n_inner, bias=config.mlp_fc1_bias)
        self.fc2 = nn.Linear(config.n_inner, config.n_embd, bias=config.mlp_fc2_bias)

    def forward(self, x):
        return self.fc2(self.fc12(x) * F.silu(self.fc11(x)))


class NomicBertBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attn = NomicBertAttention(config)
        self.mlp = NomciBertGatedMLP(config)
        self.dropout1 = nn.Dropout(0.0)
        self.dropout2 = nn.Dropout(0.0)
        self.norm1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.norm2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    def forward(self, hidden_states, attention_mask=None):
        attn_outputs = self.attn(hidden_states, attention_mask=attention_mask)
        hidden_states = self.norm1(self.dropout1(attn_outputs) + hidden_states)
        mlp_out = self.mlp(hidden_states)
        return self.norm2(self.dropout2(mlp_out) + hidden_states)


class NomicBertEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([NomicBertBlock(config) for _ in range(config.n_layer)])

    def forward(self, hidden_states, attention_mask=None):
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask=attention_mask)
        return hidden_states


class NomicBertModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embeddings = NomicBertEmbeddings(config)
        self.emb_drop = nn.Dropout(0.0)
        self.emb_ln = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.encoder = NomicBertEncoder(config)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None):
        hidden_states = self.emb_ln(self.emb_drop(self.embeddings(input_ids, token_type_ids)))
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        extended = (1.0 - attention_mask[:, None, None, :].to(hidden_states.dtype)) * torch.finfo(
            hidden_states.dtype
        ).min
        return self.encoder(hidden_states, attention_mask=extended)


class NomicBertPredictionHeadTransform(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.n_embd, config.n_embd)
        self.layer_norm = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    def forward(self, x):
        return self.layer_norm(F.gelu(self.dense(x)))


class NomicBertLMPredictionHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transform = NomicBertPredictionHeadTransform(config)
        self.decoder = nn.Linear(config.n_embd, config.vocab_size, bias=True)

    def forward(self, x):
        return self.decoder(self.transform(x))


class NomicBertPreTrainingHeads(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.predictions = NomicBertLMPredictionHead(config)

    def forward(self, x):
        return self.predictions(x)


class NomicBertForPreTraining(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.bert = NomicBertModel(config)
        self.cls = NomicBertPreTrainingHeads(config)
        self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight

    def forward(self, input_ids, attention_mask=None, token_type_ids=None):
        return MaskedLMOutput(self.cls(self.bert(input_ids, attention_mask, token_type_ids)))


def make_model():
    torch.manual_seed(6103)
    model = NomicBertForPreTraining(NomicBertConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
                m.bias.copy_(0.1 * torch.randn_like(m.bias))
    return model.eval()
