"""AllenNLP-style MultiHeadSelfAttention: one combined projection split q/k/v, bmm over heads folded into batch, masked_softmax helper, causal option."""

import torch
import torch.nn.functional as F
from torch.nn import Dropout, Linear, Module


def min_value_of_dtype(dtype):
    return torch.finfo(dtype).min


def masked_softmax(vector, mask, dim=-1, memory_efficient=True):
    """Softmax over `dim` where mask == 0 entries are excluded (memory-efficient fill variant)."""
    if mask is None:
        return F.softmax(vector, dim=dim)
    mask = mask.bool()
    while mask.dim() < vector.dim():
        mask = mask.unsqueeze(1)
    if not memory_efficient:
        raise NotImplementedError("only the fill variant is kept in this port")
    masked_vector = vector.masked_fill(~mask, min_value_of_dtype(vector.dtype))
    return F.softmax(masked_vector, dim=dim)


class MultiHeadSelfAttention(Module):
    def __init__(
        self,
        num_heads,
        input_dim,
        attention_dim,
        values_dim,
        output_projection_dim=None,
        attention_dropout_prob=0.1,
        causal=False,
    ):
        super().__init__()
        self._num_heads = num_heads
        self._input_dim = input_dim
        self._output_dim = output_projection_dim or input_dim
        self._attention_dim = attention_dim
        self._values_dim = values_dim
        self._causal = causal
        if attention_dim % num_heads != 0 or values_dim % num_heads != 0:
            raise ValueError("attention_dim and values_dim must be divisible by num_heads")

        self._combined_projection = Linear(input_dim, 2 * attention_dim + values_dim)
        self._scale = (attention_dim // num_heads) ** 0.5
        self._output_projection = Linear(values_dim, self._output_dim)
        self._attention_dropout = Dropout(attention_dropout_prob)

    def forward(self, inputs, mask=None):
        num_heads = self._num_heads
        batch_size, timesteps, _ = inputs.size()
        if mask is None:
            mask = inputs.new_ones(batch_size, timesteps)

        combined_projection = self._combined_projection(inputs)
        queries, keys, *values = combined_projection.split(self._attention_dim, -1)
        queries = queries.contiguous()
        keys = keys.contiguous()
        values = torch.cat(values, -1).contiguous()

        def per_head(t, width):
            t = (
                t.view(batch_size, timesteps, num_heads, width // num_heads)
                .transpose(1, 2)
                .contiguous()
            )
            return t.view(batch_size * num_heads, timesteps, width // num_heads)

        values_per_head = per_head(values, self._values_dim)
        queries_per_head = per_head(queries, self._attention_dim)
        keys_per_head = per_head(keys, self._attention_dim)

        scaled_similarities = torch.bmm(
            queries_per_head / self._scale, keys_per_head.transpose(1, 2)
        )

        # (batch * heads, timesteps) padding mask, optionally combined with a causal one
        pad = mask.repeat(1, num_heads).view(batch_size * num_heads, timesteps)
        full = pad.unsqueeze(1).expand(-1, timesteps, -1)
        if self._causal:
            full = full * torch.tril(
                torch.ones(timesteps, timesteps, device=inputs.device, dtype=full.dtype)
            )
        attention = masked_softmax(scaled_similarities, full)
        attention = self._attention_dropout(attention)

        outputs = torch.bmm(attention, values_per_head)
        outputs = outputs.view(batch_size, num_heads, timesteps, self._values_dim // num_heads)
        outputs = outputs.transpose(1, 2).contiguous().view(batch_size, timesteps, self._values_dim)
        return self._output_projection(outputs)


def make_attention():
    return MultiHeadSelfAttention(
        num_heads=2,
        input_dim=12,
        attention_dim=12,
        values_dim=12,
        attention_dropout_prob=0.0,
        causal=True,
    )


EXPECT = {
    "target": "make_attention",
    "kind": "causal-multihead",
    "ok": True,
    "style": "AllenNLP MultiHeadSelfAttention (_combined_projection split q/k/*values, masked_softmax, bmm), causal",
}
