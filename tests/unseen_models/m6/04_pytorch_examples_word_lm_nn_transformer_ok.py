"""The Transformer language model of pytorch/examples `word_language_model/model.py` (written from
memory, in my own words): `TransformerModel` *subclasses* `nn.Transformer`, keeps its encoder
(`encoder.layers.N` are stock `nn.TransformerEncoderLayer`s, post-norm, relu, with the stack's final
`encoder.norm`) and overwrites `self.decoder` with the output Linear; `input_emb` × sqrt(ninp),
the example's `PositionalEncoding` (sin/cos interleaved table stored as (max_len, 1, d), sequence
first), a square subsequent mask of −inf above the diagonal (`_generate_square_subsequent_mask`),
log_softmax at the end.

Attention is torch's own `nn.MultiheadAttention` (`encoder.layers.N.self_attn`, fused in_proj_weight
with bias, out_proj), run sequence-first: the example's model takes (seq, batch); this copy takes
(batch, tokens) and transposes on the way in and out, so the attention modules see (T, B, C).
batch_first is False, so torch's fast path is never taken.  2 layers, 4 heads, d 64, vocab 90.
No cache.  Returns log-probabilities (batch, tokens, vocab).
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["encoder.layers.0.self_attn", "encoder.layers.1.self_attn"],
    "kind": "causal-multihead",
    "cache": None,
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
    "style": "pytorch/examples word_language_model: TransformerModel(nn.Transformer), stock nn.TransformerEncoderLayer "
    "(post-norm) with nn.MultiheadAttention sequence-first, float -inf subsequent mask, self.decoder replaced by Linear",
}


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, dropout=0.1, max_len=500):
        super().__init__()
        self.dropout = nn.Dropout(p=dropout)
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len, dtype=torch.float).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        pe = pe.unsqueeze(0).transpose(0, 1)
        self.register_buffer("pe", pe)

    def forward(self, x):
        x = x + self.pe[: x.size(0), :]
        return self.dropout(x)


class TransformerModel(nn.Transformer):
    def __init__(self, ntoken, ninp, nhead, nhid, nlayers, dropout=0.5):
        super().__init__(
            d_model=ninp,
            nhead=nhead,
            dim_feedforward=nhid,
            num_encoder_layers=nlayers,
            num_decoder_layers=1,
            dropout=dropout,
        )
        self.model_type = "Transformer"
        self.src_mask = None
        self.pos_encoder = PositionalEncoding(ninp, dropout)
        self.input_emb = nn.Embedding(ntoken, ninp)
        self.ninp = ninp
        self.decoder = nn.Linear(ninp, ntoken)
        self.init_weights()

    @staticmethod
    def _generate_square_subsequent_mask(sz):
        return torch.log(torch.tril(torch.ones(sz, sz)))

    def init_weights(self):
        initrange = 0.1
        nn.init.uniform_(self.input_emb.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def forward(self, src, has_mask=True):
        src = src.t()  # this copy takes (batch, tokens); the example works on (seq, batch)
        if has_mask:
            device = src.device
            if self.src_mask is None or self.src_mask.size(0) != len(src):
                self.src_mask = self._generate_square_subsequent_mask(len(src)).to(device)
        else:
            self.src_mask = None
        src = self.input_emb(src) * math.sqrt(self.ninp)
        src = self.pos_encoder(src)
        mask = None if self.src_mask is None else self.src_mask.to(src.dtype)
        output = self.encoder(src, mask=mask)
        output = self.decoder(output)
        return F.log_softmax(output, dim=-1).transpose(0, 1)


def make_model():
    torch.manual_seed(6104)
    model = TransformerModel(ntoken=90, ninp=64, nhead=4, nhid=128, nlayers=2, dropout=0.2)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
                m.bias.copy_(0.1 * torch.randn_like(m.bias))
        for layer in model.encoder.layers:
            layer.self_attn.in_proj_bias.copy_(
                0.05 * torch.randn_like(layer.self_attn.in_proj_bias)
            )
    return model.eval()
