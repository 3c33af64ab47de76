"""diffusers Attention with a custom attention-map-storing processor (prompt-to-prompt style); bug: the processor never applies attn.scale."""

import torch
from torch import nn


class AttentionStore:
    def __init__(self):
        self.maps = []

    def __call__(self, probs, is_cross):
        if not is_cross:
            self.maps.append(probs.detach())


class StoringAttnProcessor:
    """Like the default processor, but records the attention maps for later editing."""

    def __init__(self, store: AttentionStore):
        self.store = store

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None):
        batch_size, sequence_length, _ = hidden_states.shape
        is_cross = encoder_hidden_states is not None
        query = attn.to_q(hidden_states)
        context = encoder_hidden_states if is_cross else hidden_states
        key = attn.to_k(context)
        value = attn.to_v(context)

        query = attn.head_to_batch_dim(query)
        key = attn.head_to_batch_dim(key)
        value = attn.head_to_batch_dim(value)

        scores = torch.bmm(query, key.transpose(-1, -2))
        if attention_mask is not None:
            scores = scores + attention_mask
        probs = scores.softmax(dim=-1)
        self.store(probs, is_cross)

        hidden_states = torch.bmm(probs, value)
        hidden_states = attn.batch_to_head_dim(hidden_states)
        hidden_states = attn.to_out[0](hidden_states)
        return attn.to_out[1](hidden_states)


class Attention(nn.Module):
    def __init__(
        self, query_dim, cross_attention_dim=None, heads=8, dim_head=64, dropout=0.0, bias=False
    ):
        super().__init__()
        inner_dim = dim_head * heads
        cross_attention_dim = cross_attention_dim or query_dim
        self.scale = dim_head**-0.5
        self.heads = heads
        self.to_q = nn.Linear(query_dim, inner_dim, bias=bias)
        self.to_k = nn.Linear(cross_attention_dim, inner_dim, bias=bias)
        self.to_v = nn.Linear(cross_attention_dim, inner_dim, bias=bias)
        self.to_out = nn.ModuleList([nn.Linear(inner_dim, query_dim), nn.Dropout(dropout)])
        self.processor = None

    def set_processor(self, processor):
        self.processor = processor

    def head_to_batch_dim(self, tensor):
        b, n, d = tensor.shape
        tensor = tensor.reshape(b, n, self.heads, d // self.heads).permute(0, 2, 1, 3)
        return tensor.reshape(b * self.heads, n, d // self.heads)

    def batch_to_head_dim(self, tensor):
        bh, n, d = tensor.shape
        tensor = tensor.reshape(bh // self.heads, self.heads, n, d).permute(0, 2, 1, 3)
        return tensor.reshape(bh // self.heads, n, d * self.heads)

    def forward(
        self,
        hidden_states,
        encoder_hidden_states=None,
        attention_mask: torch.Tensor | None = None,
    ):
        return self.processor(self, hidden_states, encoder_hidden_states, attention_mask)


def make_attention():
    attn = Attention(query_dim=20, heads=4, dim_head=5)
    attn.set_processor(StoringAttnProcessor(AttentionStore()))
    return attn


EXPECT = {
    "target": "make_attention",
    "kind": "multihead",
    "ok": False,
    "stage": "scaled_scores",
    "mistake": "missing_scale",
    "style": "diffusers Attention with a prompt-to-prompt style storing processor (attn.scale forgotten)",
}
