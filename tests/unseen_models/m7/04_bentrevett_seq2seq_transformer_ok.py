"""bentrevett/pytorch-seq2seq "Attention is All You Need" notebook model, as one whole model.

Encoder and Decoder (learned pos_embedding, tok_embedding * sqrt(hid_dim)), post-norm layers,
MultiHeadAttentionLayer with fc_q/fc_k/fc_v/fc_o, energy = Q K^T / scale (a sqrt(head_dim)
buffer), masked_fill(mask == 0, -1e10), returning (x, attention).  The source is the token ids;
the target is built inside the model by shifting them right behind a BOS id.  No padding id is
ever produced (src_pad_idx = trg_pad_idx = -1), so the masks are the decoder's causal mask only.
No cache.
"""

import torch
import torch.nn as nn

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": [
        "encoder.layers.0.self_attention",
        "encoder.layers.1.self_attention",
        "decoder.layers.0.self_attention",
        "decoder.layers.0.encoder_attention",
        "decoder.layers.1.self_attention",
        "decoder.layers.1.encoder_attention",
    ],
    "kind": "causal-multihead",
    "kinds": {
        "encoder.layers.0.self_attention": "multihead",
        "encoder.layers.1.self_attention": "multihead",
        "decoder.layers.0.self_attention": "causal-multihead",
        "decoder.layers.0.encoder_attention": "cross",
        "decoder.layers.1.self_attention": "causal-multihead",
        "decoder.layers.1.encoder_attention": "cross",
    },
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
    "style": "bentrevett pytorch-seq2seq Transformer: Encoder/Decoder/Seq2Seq, MultiHeadAttentionLayer fc_q/fc_k/fc_v/fc_o "
    "called (query, key, value, mask) returning (x, attention), energy / sqrt(head_dim) buffer, -1e10 fill, post-norm; "
    "decoder input = BOS + ids[:, :-1] built inside",
}


class MultiHeadAttentionLayer(nn.Module):
    def __init__(self, hid_dim, n_heads, dropout):
        super().__init__()
        assert hid_dim % n_heads == 0
        self.hid_dim = hid_dim
        self.n_heads = n_heads
        self.head_dim = hid_dim // n_heads
        self.fc_q = nn.Linear(hid_dim, hid_dim)
        self.fc_k = nn.Linear(hid_dim, hid_dim)
        self.fc_v = nn.Linear(hid_dim, hid_dim)
        self.fc_o = nn.Linear(hid_dim, hid_dim)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("scale", torch.sqrt(torch.tensor([float(self.head_dim)])))

    def forward(self, query, key, value, mask=None):
        batch_size = query.shape[0]
        Q = self.fc_q(query)
        K = self.fc_k(key)
        V = self.fc_v(value)
        Q = Q.view(batch_size, -1, self.n_heads, self.head_dim).permute(0, 2, 1, 3)
        K = K.view(batch_size, -1, self.n_heads, self.head_dim).permute(0, 2, 1, 3)
        V = V.view(batch_size, -1, self.n_heads, self.head_dim).permute(0, 2, 1, 3)
        energy = torch.matmul(Q, K.permute(0, 1, 3, 2)) / self.scale.to(Q.dtype)
        if mask is not None:
            energy = energy.masked_fill(mask == 0, -1e10)
        attention = torch.softmax(energy, dim=-1)
        x = torch.matmul(self.dropout(attention), V)
        x = x.permute(0, 2, 1, 3).contiguous()
        x = x.view(batch_size, -1, self.hid_dim)
        x = self.fc_o(x)
        return x, attention


class PositionwiseFeedforwardLayer(nn.Module):
    def __init__(self, hid_dim, pf_dim, dropout):
        super().__init__()
        self.fc_1 = nn.Linear(hid_dim, pf_dim)
        self.fc_2 = nn.Linear(pf_dim, hid_dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.fc_2(self.dropout(torch.relu(self.fc_1(x))))


class EncoderLayer(nn.Module):
    def __init__(self, hid_dim, n_heads, pf_dim, dropout):
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(hid_dim)
        self.ff_layer_norm = nn.LayerNorm(hid_dim)
        self.self_attention = MultiHeadAttentionLayer(hid_dim, n_heads, dropout)
        self.positionwise_feedforward = PositionwiseFeedforwardLayer(hid_dim, pf_dim, dropout)
        self.dropout = nn.Dropout(dropout)

    def forward(self, src, src_mask):
        _src, _ = self.self_attention(src, src, src, src_mask)
        src = self.self_attn_layer_norm(src + self.dropout(_src))
        _src = self.positionwise_feedforward(src)
        return self.ff_layer_norm(src + self.dropout(_src))


class Encoder(nn.Module):
    def __init__(self, input_dim, hid_dim, n_layers, n_heads, pf_dim, dropout, max_length=64):
        super().__init__()
        self.tok_embedding = nn.Embedding(input_dim, hid_dim)
        self.pos_embedding = nn.Embedding(max_length, hid_dim)
        self.layers = nn.ModuleList(
            [EncoderLayer(hid_dim, n_heads, pf_dim, dropout) for _ in range(n_layers)]
        )
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("scale", torch.sqrt(torch.tensor([float(hid_dim)])))

    def forward(self, src, src_mask):
        batch_size, src_len = src.shape
        pos = torch.arange(0, src_len, device=src.device).unsqueeze(0).repeat(batch_size, 1)
        src = self.dropout(
            self.tok_embedding(src) * self.scale.to(self.tok_embedding.weight.dtype)
            + self.pos_embedding(pos)
        )
        for layer in self.layers:
            src = layer(src, src_mask)
        return src


class DecoderLayer(nn.Module):
    def __init__(self, hid_dim, n_heads, pf_dim, dropout):
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(hid_dim)
        self.enc_attn_layer_norm = nn.LayerNorm(hid_dim)
        self.ff_layer_norm = nn.LayerNorm(hid_dim)
        self.self_attention = MultiHeadAttentionLayer(hid_dim, n_heads, dropout)
        self.encoder_attention = MultiHeadAttentionLayer(hid_dim, n_heads, dropout)
        self.positionwise_feedforward = PositionwiseFeedforwardLayer(hid_dim, pf_dim, dropout)
        self.dropout = nn.Dropout(dropout)

    def forward(self, trg, enc_src, trg_mask, src_mask):
        _trg, _ = self.self_attention(trg, trg, trg, trg_mask)
        trg = self.self_attn_layer_norm(trg + self.dropout(_trg))
        _trg, attention = self.encoder_attention(trg, enc_src, enc_src, src_mask)
        trg = self.enc_attn_layer_norm(trg + self.dropout(_trg))
        _trg = self.positionwise_feedforward(trg)
        return self.ff_layer_norm(trg + self.dropout(_trg)), attention


class Decoder(nn.Module):
    def __init__(self, output_dim, hid_dim, n_layers, n_heads, pf_dim, dropout, max_length=64):
        super().__init__()
        self.tok_embedding = nn.Embedding(output_dim, hid_dim)
        self.pos_embedding = nn.Embedding(max_length, hid_dim)
        self.layers = nn.ModuleList(
            [DecoderLayer(hid_dim, n_heads, pf_dim, dropout) for _ in range(n_layers)]
        )
        self.fc_out = nn.Linear(hid_dim, output_dim)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("scale", torch.sqrt(torch.tensor([float(hid_dim)])))

    def forward(self, trg, enc_src, trg_mask, src_mask):
        batch_size, trg_len = trg.shape
        pos = torch.arange(0, trg_len, device=trg.device).unsqueeze(0).repeat(batch_size, 1)
        trg = self.dropout(
            self.tok_embedding(trg) * self.scale.to(self.tok_embedding.weight.dtype)
            + self.pos_embedding(pos)
        )
        for layer in self.layers:
            trg, attention = layer(trg, enc_src, trg_mask, src_mask)
        return self.fc_out(trg), attention


class Seq2Seq(nn.Module):
    def __init__(self, encoder, decoder, src_pad_idx=-1, trg_pad_idx=-1, trg_bos_idx=1):
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder
        self.src_pad_idx = src_pad_idx
        self.trg_pad_idx = trg_pad_idx
        self.trg_bos_idx = trg_bos_idx

    def make_src_mask(self, src):
        return (src != self.src_pad_idx).unsqueeze(1).unsqueeze(2)

    def make_trg_mask(self, trg):
        trg_pad_mask = (trg != self.trg_pad_idx).unsqueeze(1).unsqueeze(2)
        trg_len = trg.shape[1]
        trg_sub_mask = torch.tril(torch.ones((trg_len, trg_len), device=trg.device)).bool()
        return trg_pad_mask & trg_sub_mask

    def forward(self, src):
        bos = torch.full_like(src[:, :1], self.trg_bos_idx)
        trg = torch.cat([bos, src[:, :-1]], dim=1)
        src_mask = self.make_src_mask(src)
        trg_mask = self.make_trg_mask(trg)
        enc_src = self.encoder(src, src_mask)
        output, attention = self.decoder(trg, enc_src, trg_mask, src_mask)
        return output


def make_model():
    torch.manual_seed(704)
    enc = Encoder(100, 64, 2, 4, 128, 0.1)
    dec = Decoder(100, 64, 2, 4, 128, 0.1)
    model = Seq2Seq(enc, dec)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name:
                if name.endswith("weight"):
                    p.copy_(1.0 + 0.3 * torch.randn_like(p))
                else:
                    p.copy_(0.1 * torch.randn_like(p))
            elif p.dim() > 1:
                nn.init.xavier_uniform_(p)
            else:
                p.normal_(0.0, 0.02)
    return model.eval()
