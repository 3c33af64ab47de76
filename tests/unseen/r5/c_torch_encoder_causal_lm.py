"""Decoder-only LM built from nn.TransformerEncoder (pre-norm) with a square subsequent mask passed each call."""

import torch
from torch import nn


class CausalEncoderLM(nn.Module):
    def __init__(self, d_model=12, nhead=3, num_layers=1, block_size=64):
        super().__init__()
        layer = nn.TransformerEncoderLayer(
            d_model,
            nhead,
            dim_feedforward=4 * d_model,
            dropout=0.0,
            batch_first=True,
            norm_first=True,
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.register_buffer(
            "causal_mask",
            nn.Transformer.generate_square_subsequent_mask(block_size),
            persistent=False,
        )
        self.ln_f = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.size(-2)
        mask = self.causal_mask[:t, :t]
        return self.ln_f(self.encoder(x, mask=mask, is_causal=True))


def make_model():
    return CausalEncoderLM(d_model=12, nhead=3, num_layers=1, block_size=64)


EXPECT = {
    "target": "make_model",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "encoder.layers.0.self_attn",
    "style": "decoder-only LM on nn.TransformerEncoder (norm_first) with generate_square_subsequent_mask and is_causal=True",
}
