"""Decoder-only LM on nn.TransformerEncoder; bug: only is_causal=True is passed (no mask), which the encoder treats as a hint and ignores."""

import torch
from torch import nn


class TinyCausalLM(nn.Module):
    def __init__(self, d_model=20, nhead=4, num_layers=1):
        super().__init__()
        layer = nn.TransformerEncoderLayer(
            d_model,
            nhead,
            dim_feedforward=2 * d_model,
            dropout=0.0,
            batch_first=True,
            norm_first=True,
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.ln_f = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln_f(self.encoder(x, is_causal=True))


def make_model():
    return TinyCausalLM(d_model=20, nhead=4, num_layers=1)


EXPECT = {
    "target": "make_model",
    "kind": "causal-multihead",
    "unsupported": "fast_path",
    "style": "decoder-only LM on nn.TransformerEncoder with is_causal=True but no mask (silently unmasked)",
}
