"""GPT-SoVITS text-to-semantic AR decoder (RVC-Boss/GPT-SoVITS, GPT_SoVITS/AR/models/t2s_model.py).

Only the semantic-token stream is kept: ar_audio_embedding (TokenEmbedding.word_embeddings),
ar_audio_position (SinePositionalEmbedding, scale False, learned alpha: x + alpha * pe, sin on even /
cos on odd features, tables in float64 at call time), h.layers.N (post-norm TransformerEncoderLayer:
self_attn with a packed in_proj_weight / in_proj_bias and out_proj, norm1, ReLU linear1/linear2,
norm2) and ar_predict_layer (no bias).  The attention follows T2SBlock: process_prompt with a boolean
triu mask (True = hidden) handed inverted to SDPA; decode_next_token concatenates the projected
(b, T, 64) k_cache / v_cache and runs SDPA without a mask on the one new frame.
Cache: hf: `out = model(ids, use_cache=True)`, then
`model(tok, past_key_values=out.past_key_values, use_cache=True)`; `out.logits`; past_key_values is
a list of (k_cache, v_cache), each (b, T, 64) unsplit, one per layer.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["h.layers.0.self_attn", "h.layers.1.self_attn", "h.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": "hf",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "GPT-SoVITS T2S: packed in_proj, post-norm, sine positions with learned alpha, boolean "
    "mask inverted into SDPA, decode_next_token with (b, T, 64) k/v caches; 3 layers",
}


class TokenEmbedding(nn.Module):
    """AR/modules/embedding.py TokenEmbedding: a word_embeddings table (dropout 0 at inference)."""

    def __init__(self, embedding_dim, vocab_size):
        super().__init__()
        self.vocab_size = vocab_size
        self.embedding_dim = embedding_dim
        self.word_embeddings = nn.Embedding(vocab_size, embedding_dim)

    def forward(self, x):
        return self.word_embeddings(x)


class SinePositionalEmbedding(nn.Module):
    """x * x_scale + alpha * pe, pe with sin on even and cos on odd features (alpha is learned)."""

    def __init__(self, embedding_dim, scale=False, alpha=False):
        super().__init__()
        self.embedding_dim = embedding_dim
        self.x_scale = math.sqrt(embedding_dim) if scale else 1.0
        self.alpha = nn.Parameter(torch.ones(1), requires_grad=alpha)

    def _table(self, start, length, dtype, device):
        position = torch.arange(
            start, start + length, dtype=torch.float64, device=device
        )[:, None]
        step = -(math.log(10000.0) / self.embedding_dim)
        div_term = torch.exp(
            torch.arange(0, self.embedding_dim, 2, dtype=torch.float64, device=device)
            * step
        )
        pe = torch.zeros(length, self.embedding_dim, dtype=torch.float64, device=device)
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        return pe.to(dtype)[None]

    def forward(self, x, offset=0):
        return x * self.x_scale + self.alpha * self._table(
            offset, x.size(1), x.dtype, x.device
        )


class MultiheadAttention(nn.Module):
    """The attention of a T2S block: one packed in_proj (q, k, v chunks), out_proj.

    Without a cache it is T2SBlock.process_prompt (boolean mask, True = hidden, handed to SDPA
    inverted); with a cache it is decode_next_token: the projected (b, T, d) k_cache / v_cache are
    concatenated on the token axis before the heads are cut.
    """

    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim))
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        nn.init.xavier_uniform_(self.in_proj_weight)
        nn.init.normal_(self.in_proj_bias, std=0.05)

    def _heads(self, t, batch_size, length):
        return t.view(batch_size, length, self.num_heads, -1).transpose(1, 2)

    def _attend(self, q, k, v, attn_mask):
        if attn_mask is None:
            return F.scaled_dot_product_attention(q, k, v)
        return F.scaled_dot_product_attention(q, k, v, ~attn_mask)

    def _merge(self, attn, batch_size, q_len):
        attn = attn.permute(2, 0, 1, 3).reshape(batch_size * q_len, self.embed_dim)
        return attn.view(q_len, batch_size, self.embed_dim).transpose(1, 0)

    def _project_out(self, attn):
        return F.linear(attn, self.out_proj.weight, self.out_proj.bias)

    def forward(self, x, attn_mask=None, cache=None):
        q, k, v = F.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        if cache is None:
            k_cache, v_cache = k, v
        else:
            k_cache = torch.cat([cache[0], k], dim=1)
            v_cache = torch.cat([cache[1], v], dim=1)
        batch_size, q_len = q.shape[0], q.shape[1]
        kv_len = k_cache.shape[1]
        q = self._heads(q, batch_size, q_len)
        k = self._heads(k_cache, batch_size, kv_len)
        v = self._heads(v_cache, batch_size, kv_len)
        attn = self._attend(q, k, v, attn_mask)
        attn = self._merge(attn, batch_size, q_len)
        return self._project_out(attn), (k_cache, v_cache)


ATTENTION_CLASSES = {"mha": MultiheadAttention}


class TransformerEncoderLayer(nn.Module):
    """Post-norm (norm_first=False): x = norm1(x + attn(x)); x = norm2(x + ffn(x)); ReLU FFN."""

    def __init__(self, d_model, nhead, dim_feedforward, attention="mha"):
        super().__init__()
        self.self_attn = ATTENTION_CLASSES[attention](d_model, nhead)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)

    def forward(self, x, attn_mask=None, cache=None):
        attn, present = self.self_attn(x, attn_mask=attn_mask, cache=cache)
        x = self.norm1(x + attn)
        x = self.norm2(x + self.linear2(F.relu(self.linear1(x))))
        return x, present


class TransformerEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList(
            [
                TransformerEncoderLayer(
                    config.hidden_dim,
                    config.head,
                    config.hidden_dim * 4,
                    config.attention[i],
                )
                for i in range(config.n_layer)
            ]
        )


class Text2SemanticDecoder(nn.Module):
    """The semantic-token half of GPT-SoVITS's AR model: audio embedding, sine positions, h, head."""

    def __init__(self, config):
        super().__init__()
        self.model_dim = config.hidden_dim
        self.num_head = config.head
        self.num_layers = config.n_layer
        self.ar_audio_embedding = TokenEmbedding(
            config.embedding_dim, config.vocab_size
        )
        self.ar_audio_position = SinePositionalEmbedding(
            config.embedding_dim, scale=False, alpha=True
        )
        self.h = TransformerEncoder(config)
        self.ar_predict_layer = nn.Linear(self.model_dim, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        y_len = input_ids.shape[1]
        past = 0 if past_key_values is None else past_key_values[0][0].shape[1]
        y_emb = self.ar_audio_embedding(input_ids)
        xy_pos = self.ar_audio_position(y_emb, offset=past)
        if past_key_values is not None and y_len == 1:
            # decode_next_token: one frame against the whole cache, no mask
            xy_attn_mask = None
        else:
            xy_attn_mask = F.pad(
                torch.triu(
                    torch.ones(y_len, y_len, dtype=torch.bool, device=input_ids.device),
                    diagonal=1,
                ),
                (past, 0),
                value=False,
            )
        k_v = []
        for i, layer in enumerate(self.h.layers):
            cache = None if past_key_values is None else past_key_values[i]
            xy_pos, present = layer(xy_pos, attn_mask=xy_attn_mask, cache=cache)
            k_v.append(present)
        logits = self.ar_predict_layer(xy_pos)
        return SimpleNamespace(
            logits=logits, past_key_values=k_v if use_cache else None
        )


def make_model():
    torch.manual_seed(3401)
    config = SimpleNamespace(
        vocab_size=96,
        embedding_dim=64,
        hidden_dim=64,
        head=4,
        n_layer=3,
        attention=["mha", "mha", "mha"],
    )
    model = Text2SemanticDecoder(config)
    g = torch.Generator().manual_seed(34011)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
        model.ar_audio_position.alpha.fill_(0.8)
    return model.eval()
