"""MPNet masked LM after transformers' modeling_mpnet.py.

MPNetForMaskedLM: mpnet (MPNetModel: embeddings, encoder) and lm_head (dense, gelu, layer_norm,
decoder + bias).  MPNetEmbeddings: word_embeddings, position_embeddings with RoBERTa-style positions
(padding_idx 1, real tokens numbered from padding_idx + 1 by a cumsum over non-pad ids), LayerNorm.
MPNetEncoder: layer.N (MPNetLayer: attention (MPNetAttention: attn (MPNetSelfAttention: q, k, v, o
with bias), LayerNorm after the residual, post-norm), intermediate.dense + gelu, output.dense +
LayerNorm) and one `relative_attention_bias` Embedding(32 buckets, heads) shared by every layer:
bidirectional T5-style log buckets (max_distance 128) of key - query, computed once per forward as
position_bias (1, heads, q, k).  MPNetSelfAttention: scores = q @ k^T / sqrt(hd) + position_bias,
+ additive padding mask (all visible by default), softmax, context, and its *own* output projection `o`.
Encoder, no cache.  Returns an object with `.logits`.  Padding is only applied through attention_mask
(all ones by default) and positions number every token, so id 1 is an ordinary token here.
Correct.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["mpnet.encoder.layer.0.attention.attn", "mpnet.encoder.layer.1.attention.attn",
               "mpnet.encoder.layer.2.attention.attn"],
    "kind": "multihead",
    "cache": None,
    "style": "modeling_mpnet.py: encoder.layer.N.attention.attn with q/k/v/o (own out-proj), shared learned "
    "relative_attention_bias (32 bidirectional log buckets) added after the 1/sqrt(d) scale, post-norm, "
    "RoBERTa-offset learned positions",
}


class MPNetEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.padding_idx = 1
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=self.padding_idx)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size,
                                                padding_idx=self.padding_idx)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids):
        seq_length = input_ids.shape[1]
        position_ids = torch.arange(self.padding_idx + 1, seq_length + self.padding_idx + 1,
                                    device=input_ids.device)[None].expand_as(input_ids)
        return self.LayerNorm(self.word_embeddings(input_ids) + self.position_embeddings(position_ids))


class MPNetSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.q = nn.Linear(config.hidden_size, self.all_head_size)
        self.k = nn.Linear(config.hidden_size, self.all_head_size)
        self.v = nn.Linear(config.hidden_size, self.all_head_size)
        self.o = nn.Linear(config.hidden_size, config.hidden_size)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        return x.view(*new_x_shape).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None, position_bias=None):
        q = self.transpose_for_scores(self.q(hidden_states))
        k = self.transpose_for_scores(self.k(hidden_states))
        v = self.transpose_for_scores(self.v(hidden_states))
        attention_scores = torch.matmul(q, k.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if position_bias is not None:
            attention_scores = attention_scores + position_bias
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask
        attention_probs = F.softmax(attention_scores, dim=-1)
        c = torch.matmul(attention_probs, v)
        c = c.permute(0, 2, 1, 3).contiguous()
        c = c.view(*c.size()[:-2], self.all_head_size)
        return (self.o(c),)


class MPNetAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attn = MPNetSelfAttention(config)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_bias=None):
        self_outputs = self.attn(hidden_states, attention_mask, position_bias)
        return self.LayerNorm(self_outputs[0] + hidden_states)


class MPNetLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = MPNetAttention(config)
        self.intermediate = nn.Module()
        self.intermediate.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.output = nn.Module()
        self.output.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.output.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_bias=None):
        attention_output = self.attention(hidden_states, attention_mask, position_bias)
        inter = F.gelu(self.intermediate.dense(attention_output))
        return self.output.LayerNorm(self.output.dense(inter) + attention_output)


class MPNetEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.layer = nn.ModuleList([MPNetLayer(config) for _ in range(config.num_hidden_layers)])
        self.relative_attention_bias = nn.Embedding(config.relative_attention_num_buckets, self.n_heads)

    @staticmethod
    def relative_position_bucket(relative_position, num_buckets=32, max_distance=128):
        ret = 0
        n = -relative_position
        num_buckets //= 2
        ret += (n < 0).to(torch.long) * num_buckets
        n = torch.abs(n)
        max_exact = num_buckets // 2
        is_small = n < max_exact
        val_if_large = max_exact + (
            torch.log(n.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
        ).to(torch.long)
        val_if_large = torch.min(val_if_large, torch.full_like(val_if_large, num_buckets - 1))
        return ret + torch.where(is_small, n, val_if_large)

    def compute_position_bias(self, x, num_buckets=32):
        bsz, qlen, klen = x.size(0), x.size(1), x.size(1)
        context_position = torch.arange(qlen, dtype=torch.long, device=x.device)[:, None]
        memory_position = torch.arange(klen, dtype=torch.long, device=x.device)[None, :]
        relative_position = memory_position - context_position
        rp_bucket = self.relative_position_bucket(relative_position, num_buckets=num_buckets)
        values = self.relative_attention_bias(rp_bucket)
        return values.permute([2, 0, 1]).unsqueeze(0).contiguous()

    def forward(self, hidden_states, attention_mask=None):
        position_bias = self.compute_position_bias(hidden_states)
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states, attention_mask, position_bias)
        return hidden_states


class MPNetModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embeddings = MPNetEmbeddings(config)
        self.encoder = MPNetEncoder(config)

    def forward(self, input_ids, attention_mask=None):
        if attention_mask is None:
            attention_mask = torch.ones(input_ids.shape, device=input_ids.device)
        emb = self.embeddings(input_ids)
        extended = (1.0 - attention_mask[:, None, None, :].to(emb.dtype)) * torch.finfo(emb.dtype).min
        return self.encoder(emb, extended)


class MPNetLMHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, features):
        return self.decoder(self.layer_norm(F.gelu(self.dense(features)))) + self.bias


class MPNetForMaskedLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.mpnet = MPNetModel(config)
        self.lm_head = MPNetLMHead(config)

    def forward(self, input_ids, attention_mask=None):
        return SimpleNamespace(logits=self.lm_head(self.mpnet(input_ids, attention_mask)))


def make_model():
    torch.manual_seed(0)
    config = SimpleNamespace(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                             intermediate_size=128, max_position_embeddings=72, layer_norm_eps=1e-5,
                             relative_attention_num_buckets=32)
    model = MPNetForMaskedLM(config)
    with torch.no_grad():
        model.mpnet.encoder.relative_attention_bias.weight.normal_(0.0, 0.5)
    for m in model.modules():
        if isinstance(m, nn.LayerNorm):
            nn.init.uniform_(m.weight, 0.6, 1.4)
            nn.init.uniform_(m.bias, -0.1, 0.1)
    return model.eval()
