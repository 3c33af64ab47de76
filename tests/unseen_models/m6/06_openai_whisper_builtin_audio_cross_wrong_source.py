"""OpenAI Whisper (openai/whisper `model.py`, written from memory, in my own words) with the audio
built in, so that the model takes token ids only: a fixed log-mel buffer `mel` (1, 8 mels, 24 frames,
expanded to the batch) goes through `AudioEncoder` (conv1, conv2 stride 2, GELU, `sinusoids()`
positions, 2 `ResidualAttentionBlock`s, `ln_post`; 12 audio positions), and `TextDecoder`
(token_embedding, learned positional_embedding offset by the kv_cache length, 2 blocks with
self-attention `attn` and cross-attention `cross_attn` to the audio, `ln`, logits against the token
embedding).  `MultiHeadAttention` has query/key/value/out Linears (key without bias) and
`qkv_attention` scales q and k each by head_dim ** -0.25 (together 1/sqrt(head_dim)) and adds
`mask[:n_ctx, :n_ctx]` for the decoder's self-attention.  4 heads of 16, n_state 64, vocab 140.

Layer kinds (run order): encoder self-attention (bidirectional, `multihead`), decoder
self-attention (`causal-multihead`), decoder cross-attention (`cross`; context = the 12 encoder
positions).  No cache is exposed (Whisper's hook-based kv_cache is not reproduced).

Slip: decoder block 1 is built with `ported_cross=True`, a cross-attention whose forward was
rewritten for "streaming" and projects keys and values from the decoder stream `x` instead of the
audio `xa` (the two lines were copied from the self-attention path; `xa` is accepted and ignored):
`decoder.blocks.1.cross_attn`, stage `keys` (the first stage it touches), `wrong_source`.
"""

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "encoder.blocks.0.attn",
        "encoder.blocks.1.attn",
        "decoder.blocks.0.attn",
        "decoder.blocks.0.cross_attn",
        "decoder.blocks.1.attn",
        "decoder.blocks.1.cross_attn",
    ],
    "kind": "causal-multihead",
    "kinds": {
        "encoder.blocks.0.attn": "multihead",
        "encoder.blocks.1.attn": "multihead",
        "decoder.blocks.0.attn": "causal-multihead",
        "decoder.blocks.0.cross_attn": "cross",
        "decoder.blocks.1.attn": "causal-multihead",
        "decoder.blocks.1.cross_attn": "cross",
    },
    "cache": None,
    "layer": "decoder.blocks.1.cross_attn",
    "stage": "keys",
    "mistake": "wrong_source",
    "style": "openai/whisper model.py with a built-in mel buffer: AudioEncoder conv1/conv2 + sinusoids, TextDecoder with attn + "
    "cross_attn per block, q and k each scaled by hd^-0.25, key Linear without bias; slip: block 1 cross_attn keys/values from x",
}


class ModelDimensions:
    n_mels = 8
    n_audio_ctx = 12
    n_audio_state = 64
    n_audio_head = 4
    n_audio_layer = 2
    n_vocab = 140
    n_text_ctx = 48
    n_text_state = 64
    n_text_head = 4
    n_text_layer = 2


class LayerNorm(nn.LayerNorm):
    def forward(self, x):
        return super().forward(x.float() if x.dtype != torch.float64 else x).type(x.dtype)


def sinusoids(length, channels, max_timescale=10000):
    assert channels % 2 == 0
    log_timescale_increment = np.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-log_timescale_increment * torch.arange(channels // 2))
    scaled_time = torch.arange(length)[:, np.newaxis] * inv_timescales[np.newaxis, :]
    return torch.cat([torch.sin(scaled_time), torch.cos(scaled_time)], dim=1)


class MultiHeadAttention(nn.Module):
    def __init__(self, n_state, n_head):
        super().__init__()
        self.n_head = n_head
        self.query = nn.Linear(n_state, n_state)
        self.key = nn.Linear(n_state, n_state, bias=False)
        self.value = nn.Linear(n_state, n_state)
        self.out = nn.Linear(n_state, n_state)

    def forward(self, x, xa=None, mask=None):
        q = self.query(x)
        k = self.key(x if xa is None else xa)
        v = self.value(x if xa is None else xa)
        wv, qk = self.qkv_attention(q, k, v, mask)
        return self.out(wv)

    def qkv_attention(self, q, k, v, mask=None):
        n_batch, n_ctx, n_state = q.shape
        scale = (n_state // self.n_head) ** -0.25
        q = q.view(*q.shape[:2], self.n_head, -1).permute(0, 2, 1, 3) * scale
        k = k.view(*k.shape[:2], self.n_head, -1).permute(0, 2, 3, 1) * scale
        v = v.view(*v.shape[:2], self.n_head, -1).permute(0, 2, 1, 3)
        qk = q @ k
        if mask is not None:
            qk = qk + mask[:n_ctx, :n_ctx]
        w = F.softmax(qk.float() if qk.dtype != torch.float64 else qk, dim=-1).to(q.dtype)
        return (w @ v).permute(0, 2, 1, 3).flatten(start_dim=2), qk.detach()


class StreamingCrossAttention(MultiHeadAttention):
    """Cross-attention rewritten for chunked audio; the key/value lines were copied from the
    self-attention path, so the audio features never reach this layer."""

    def forward(self, x, xa=None, mask=None):
        q = self.query(x)
        k = self.key(x)
        v = self.value(x)
        wv, qk = self.qkv_attention(q, k, v, mask)
        return self.out(wv)


class ResidualAttentionBlock(nn.Module):
    def __init__(self, n_state, n_head, cross_attention=False, ported_cross=False):
        super().__init__()
        self.attn = MultiHeadAttention(n_state, n_head)
        self.attn_ln = LayerNorm(n_state)
        cross_cls = StreamingCrossAttention if ported_cross else MultiHeadAttention
        self.cross_attn = cross_cls(n_state, n_head) if cross_attention else None
        self.cross_attn_ln = LayerNorm(n_state) if cross_attention else None
        n_mlp = n_state * 2
        self.mlp = nn.Sequential(nn.Linear(n_state, n_mlp), nn.GELU(), nn.Linear(n_mlp, n_state))
        self.mlp_ln = LayerNorm(n_state)

    def forward(self, x, xa=None, mask=None):
        x = x + self.attn(self.attn_ln(x), mask=mask)
        if self.cross_attn:
            x = x + self.cross_attn(self.cross_attn_ln(x), xa)
        return x + self.mlp(self.mlp_ln(x))


class AudioEncoder(nn.Module):
    def __init__(self, n_mels, n_ctx, n_state, n_head, n_layer):
        super().__init__()
        self.conv1 = nn.Conv1d(n_mels, n_state, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(n_state, n_state, kernel_size=3, stride=2, padding=1)
        self.register_buffer("positional_embedding", sinusoids(n_ctx, n_state))
        self.blocks = nn.ModuleList(
            [ResidualAttentionBlock(n_state, n_head) for _ in range(n_layer)]
        )
        self.ln_post = LayerNorm(n_state)

    def forward(self, x):
        x = F.gelu(self.conv1(x))
        x = F.gelu(self.conv2(x))
        x = x.permute(0, 2, 1)
        x = (x + self.positional_embedding).to(x.dtype)
        for block in self.blocks:
            x = block(x)
        return self.ln_post(x)


class TextDecoder(nn.Module):
    def __init__(self, n_vocab, n_ctx, n_state, n_head, n_layer):
        super().__init__()
        self.token_embedding = nn.Embedding(n_vocab, n_state)
        self.positional_embedding = nn.Parameter(torch.empty(n_ctx, n_state))
        self.blocks = nn.ModuleList(
            [
                ResidualAttentionBlock(n_state, n_head, cross_attention=True, ported_cross=(i == 1))
                for i in range(n_layer)
            ]
        )
        self.ln = LayerNorm(n_state)
        mask = torch.empty(n_ctx, n_ctx).fill_(-np.inf).triu_(1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x, xa):
        offset = 0
        x = self.token_embedding(x) + self.positional_embedding[offset : offset + x.shape[-1]]
        x = x.to(xa.dtype)
        for block in self.blocks:
            x = block(x, xa, mask=self.mask)
        x = self.ln(x)
        return (
            (x @ torch.transpose(self.token_embedding.weight.to(x.dtype), 0, 1)).float()
            if x.dtype != torch.float64
            else x @ self.token_embedding.weight.T
        )


class WhisperWithBuiltinAudio(nn.Module):
    def __init__(self, dims):
        super().__init__()
        self.dims = dims
        self.encoder = AudioEncoder(
            dims.n_mels, dims.n_audio_ctx, dims.n_audio_state, dims.n_audio_head, dims.n_audio_layer
        )
        self.decoder = TextDecoder(
            dims.n_vocab, dims.n_text_ctx, dims.n_text_state, dims.n_text_head, dims.n_text_layer
        )
        self.register_buffer("mel", torch.randn(1, dims.n_mels, 2 * dims.n_audio_ctx))

    def embed_audio(self, batch):
        return self.encoder(self.mel.expand(batch, -1, -1))

    def forward(self, tokens):
        return self.decoder(tokens, self.embed_audio(tokens.shape[0]))


def make_model():
    torch.manual_seed(6106)
    model = WhisperWithBuiltinAudio(ModelDimensions())
    with torch.no_grad():
        model.decoder.positional_embedding.normal_(0.0, 0.3)
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
                m.bias.copy_(0.1 * torch.randn_like(m.bias))
    return model.eval()
