"""BertGenerationDecoder, after transformers' modeling_bert_generation.py (BERT weights used as a
causal decoder, is_decoder=True, no cross-attention).

bert (BertGenerationEncoder: embeddings = word + absolute position + LayerNorm, encoder.layer.N = BertLayer
post-norm) and lm_head (BertGenerationOnlyLMHead: decoder Linear).  BertSelfAttention: query/key/value
with bias, transpose_for_scores, / sqrt(d), additive extended mask, softmax, no own out-projection
(BertSelfOutput holds dense + LayerNorm).  The decoder's extended attention mask is the causal
(1 - tril) * finfo.min mask built once by the encoder.
Slip: layer 1 uses `BertGenerationShiftedSelfAttention`, a subclass written for a "predict the current
token" ablation, which replaces the mask with one built from `torch.ones(T, T).tril(diagonal=-1)`: each
token is hidden from itself (row 0 sees nothing and falls back to a uniform-by-scores softmax).
No cache.
"""
import math

import torch
import torch.nn as nn

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "bert.encoder.layer.0.attention.self",
        "bert.encoder.layer.1.attention.self",
        "bert.encoder.layer.2.attention.self",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "bert.encoder.layer.1.attention.self",
    "stage": "masked_scores",
    "mistake": "mask_diagonal",
    "style": "modeling_bert_generation.py decoder: BERT tree used causally (post-norm, self-attention without own "
    "out-proj, extended additive causal mask); layer 1 subclass masks with tril(diagonal=-1)",
}


class BertGenerationEmbeddings(nn.Module):
    def __init__(self, vocab, hidden, max_pos=64):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.position_embeddings = nn.Embedding(max_pos, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, input_ids):
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        return self.LayerNorm(self.word_embeddings(input_ids) + self.position_embeddings(pos))


class BertSelfAttention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.num_attention_heads = heads
        self.attention_head_size = hidden // heads
        self.all_head_size = hidden
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)

    def transpose_for_scores(self, x):
        return x.view(x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)).permute(0, 2, 1, 3)

    def layer_mask(self, attention_mask, hidden_states):
        return attention_mask

    def forward(self, hidden_states, attention_mask):
        q = self.transpose_for_scores(self.query(hidden_states))
        k = self.transpose_for_scores(self.key(hidden_states))
        v = self.transpose_for_scores(self.value(hidden_states))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.attention_head_size)
        scores = scores + self.layer_mask(attention_mask, hidden_states)
        probs = nn.functional.softmax(scores, dim=-1)
        ctx = torch.matmul(probs, v).permute(0, 2, 1, 3).contiguous()
        return ctx.view(ctx.size()[:-2] + (self.all_head_size,))


class BertGenerationShiftedSelfAttention(BertSelfAttention):
    def layer_mask(self, attention_mask, hidden_states):
        T = hidden_states.shape[1]
        dtype = hidden_states.dtype
        allowed = torch.ones(T, T, dtype=dtype, device=hidden_states.device).tril(diagonal=-1)
        return ((1.0 - allowed) * torch.finfo(dtype).min)[None, None]


class BertSelfOutput(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, hidden_states, input_tensor):
        return self.LayerNorm(self.dense(hidden_states) + input_tensor)


class BertAttention(nn.Module):
    def __init__(self, hidden, heads, shifted=False):
        super().__init__()
        self.self = (BertGenerationShiftedSelfAttention if shifted else BertSelfAttention)(hidden, heads)
        self.output = BertSelfOutput(hidden)

    def forward(self, hidden_states, attention_mask):
        return self.output(self.self(hidden_states, attention_mask), hidden_states)


class BertLayer(nn.Module):
    def __init__(self, hidden, heads, inter, shifted=False):
        super().__init__()
        self.attention = BertAttention(hidden, heads, shifted)
        self.intermediate = nn.Linear(hidden, inter)
        self.output_dense = nn.Linear(inter, hidden)
        self.output_LayerNorm = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, hidden_states, attention_mask):
        a = self.attention(hidden_states, attention_mask)
        return self.output_LayerNorm(self.output_dense(nn.functional.gelu(self.intermediate(a))) + a)


class BertEncoder(nn.Module):
    def __init__(self, hidden, heads, inter, n_layers):
        super().__init__()
        self.layer = nn.ModuleList([BertLayer(hidden, heads, inter, shifted=(i == 1)) for i in range(n_layers)])

    def forward(self, hidden_states, attention_mask):
        for layer in self.layer:
            hidden_states = layer(hidden_states, attention_mask)
        return hidden_states


class BertGenerationEncoder(nn.Module):
    def __init__(self, vocab=96, hidden=64, heads=4, inter=128, n_layers=3):
        super().__init__()
        self.embeddings = BertGenerationEmbeddings(vocab, hidden)
        self.encoder = BertEncoder(hidden, heads, inter, n_layers)

    def forward(self, input_ids):
        T = input_ids.shape[1]
        h = self.embeddings(input_ids)
        causal = torch.ones(T, T, dtype=h.dtype, device=h.device).tril()
        extended = ((1.0 - causal) * torch.finfo(h.dtype).min)[None, None]
        return self.encoder(h, extended)


class BertGenerationDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.bert = BertGenerationEncoder()
        self.lm_head = nn.ModuleDict(dict(decoder=nn.Linear(64, 96)))

    def forward(self, input_ids):
        return self.lm_head["decoder"](self.bert(input_ids))


def make_model():
    torch.manual_seed(1309)
    model = BertGenerationDecoder()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.2 * torch.randn_like(m.weight))
                m.bias.copy_(0.05 * torch.randn_like(m.bias))
    return model.eval()
