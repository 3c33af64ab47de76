"""tensorflow/tensor2tensor's decoder-only Transformer LM (transformer.py with prepend_mode "none",
common_attention.py, common_layers.py) ported to PyTorch.

Kept from t2t: the symbol modality multiplies embeddings by hidden_size ** 0.5; `add_timing_signal_1d`
(sin | cos halves, log timescale increment from 1 to 1e4); `shift_right_3d` feeds the decoder; every
sublayer is `layer_preprocess` (layer norm "n") then `layer_postprocess` (residual add "da");
`multihead_attention` has bias-free `q`, `k`, `v` and `output_transform` dense layers, `split_heads`
to (b, h, s, d), scales q by key_depth_per_head ** -0.5 and calls `dot_product_attention`, which adds
the `attention_bias_lower_triangle` bias (-1e9 above the diagonal) and takes the softmax;
`combine_heads`; `dense_relu_dense` FFN; final `layer_norm`; logits against the shared embedding.
Slip: layer_1 was built with hparams that set `scale_dotproduct=False` (the flag the memory-efficient
attention variant uses, carried over into this layer's call), so its q is never multiplied by
key_depth_per_head ** -0.5: the scores reach the softmax unscaled.  Layer 0 and 2 are exact.
No cache.
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
        "body.decoder.layer_0.self_attention",
        "body.decoder.layer_1.self_attention",
        "body.decoder.layer_2.self_attention",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "body.decoder.layer_1.self_attention",
    "stage": "scaled_scores",
    "mistake": "missing_scale",
    "style": "tensor2tensor transformer LM: sqrt(d) symbol modality, add_timing_signal_1d, shift_right_3d, "
    "layer_preprocess/postprocess, multihead_attention q/k/v/output_transform, attention_bias_lower_triangle "
    "-1e9; layer_1 called with scale_dotproduct=False",
}


def add_timing_signal_1d(x, min_timescale=1.0, max_timescale=1.0e4, start_index=0):
    length, channels = x.shape[1], x.shape[2]
    position = torch.arange(length, dtype=torch.float64) + start_index
    num_timescales = channels // 2
    log_timescale_increment = math.log(float(max_timescale) / float(min_timescale)) / max(num_timescales - 1, 1)
    inv_timescales = min_timescale * torch.exp(torch.arange(num_timescales, dtype=torch.float64) * -log_timescale_increment)
    scaled_time = position[:, None] * inv_timescales[None, :]
    signal = torch.cat([torch.sin(scaled_time), torch.cos(scaled_time)], dim=1)
    return x + signal.to(x.dtype)[None]


def attention_bias_lower_triangle(length, dtype, device):
    band = torch.tril(torch.ones(length, length, dtype=dtype, device=device))
    return (-1e9 * (1.0 - band))[None, None]


def shift_right_3d(x):
    return F.pad(x, (0, 0, 1, 0))[:, :-1, :]


def split_heads(x, num_heads):
    b, s, d = x.shape
    return x.view(b, s, num_heads, d // num_heads).permute(0, 2, 1, 3)


def combine_heads(x):
    b, h, s, d = x.shape
    return x.permute(0, 2, 1, 3).reshape(b, s, h * d)


def dot_product_attention(q, k, v, bias):
    logits = torch.matmul(q, k.transpose(-1, -2))
    if bias is not None:
        logits = logits + bias
    weights = F.softmax(logits, dim=-1)
    return torch.matmul(weights, v)


class MultiheadAttention(nn.Module):
    """t2t multihead_attention for self-attention (no memory antecedent)."""

    def __init__(self, hidden_size, total_key_depth, total_value_depth, num_heads, scale_dotproduct=True):
        super().__init__()
        self.num_heads = num_heads
        self.total_key_depth = total_key_depth
        self.scale_dotproduct = scale_dotproduct
        self.q = nn.Linear(hidden_size, total_key_depth, bias=False)
        self.k = nn.Linear(hidden_size, total_key_depth, bias=False)
        self.v = nn.Linear(hidden_size, total_value_depth, bias=False)
        self.output_transform = nn.Linear(total_value_depth, hidden_size, bias=False)

    def forward(self, query_antecedent, bias):
        q = split_heads(self.q(query_antecedent), self.num_heads)
        k = split_heads(self.k(query_antecedent), self.num_heads)
        v = split_heads(self.v(query_antecedent), self.num_heads)
        key_depth_per_head = self.total_key_depth // self.num_heads
        if self.scale_dotproduct:
            q = q * key_depth_per_head ** -0.5
        x = dot_product_attention(q, k, v, bias)
        return self.output_transform(combine_heads(x))


class DenseReluDense(nn.Module):
    def __init__(self, hidden_size, filter_size):
        super().__init__()
        self.conv1 = nn.Linear(hidden_size, filter_size)
        self.conv2 = nn.Linear(filter_size, hidden_size)

    def forward(self, x):
        return self.conv2(F.relu(self.conv1(x)))


class DecoderLayer(nn.Module):
    def __init__(self, hparams, scale_dotproduct):
        super().__init__()
        self.self_attention_layer_norm = nn.LayerNorm(hparams.hidden_size, eps=1e-6)
        self.self_attention = MultiheadAttention(
            hparams.hidden_size, hparams.hidden_size, hparams.hidden_size, hparams.num_heads, scale_dotproduct
        )
        self.ffn_layer_norm = nn.LayerNorm(hparams.hidden_size, eps=1e-6)
        self.ffn = DenseReluDense(hparams.hidden_size, hparams.filter_size)

    def forward(self, x, decoder_self_attention_bias):
        y = self.self_attention(self.self_attention_layer_norm(x), decoder_self_attention_bias)
        x = x + y
        y = self.ffn(self.ffn_layer_norm(x))
        return x + y


class TransformerDecoder(nn.Module):
    def __init__(self, hparams):
        super().__init__()
        for i in range(hparams.num_hidden_layers):
            scale = hparams.scale_dotproduct_per_layer[i]
            self.add_module("layer_%d" % i, DecoderLayer(hparams, scale))
        self.num_layers = hparams.num_hidden_layers
        self.layer_norm = nn.LayerNorm(hparams.hidden_size, eps=1e-6)

    def forward(self, x, bias):
        for i in range(self.num_layers):
            x = getattr(self, "layer_%d" % i)(x, bias)
        return self.layer_norm(x)


class Body(nn.Module):
    def __init__(self, hparams):
        super().__init__()
        self.decoder = TransformerDecoder(hparams)


class TransformerLM(nn.Module):
    def __init__(self, hparams):
        super().__init__()
        self.hparams = hparams
        self.shared = nn.Embedding(hparams.vocab_size, hparams.hidden_size)
        self.body = Body(hparams)

    def forward(self, targets):
        h = self.hparams.hidden_size
        x = self.shared(targets) * h ** 0.5
        decoder_input = shift_right_3d(x)
        decoder_input = add_timing_signal_1d(decoder_input)
        bias = attention_bias_lower_triangle(targets.shape[1], x.dtype, x.device)
        out = self.body.decoder(decoder_input, bias)
        return F.linear(out, self.shared.weight)



def make_model():
    torch.manual_seed(2205)
    hparams = SimpleNamespace(
        vocab_size=96, hidden_size=64, num_heads=4, filter_size=192, num_hidden_layers=3,
        scale_dotproduct_per_layer=[True, False, True],
    )
    model = TransformerLM(hparams)
    g = torch.Generator().manual_seed(22051)
    with torch.no_grad():
        model.shared.weight.mul_(hparams.hidden_size ** -0.5)
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()
