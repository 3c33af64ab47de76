"""GluonNLP's numpy-API GPT-2 (gluonnlp/models/gpt2.py) ported to PyTorch, block by block.

GPT2ForLM -> _backbone_model (GPT2Model: _embed, _pos_embed (learned), _layers.N, _final_ln), the
LM head tied to _embed.weight.  GPT2Layer = atten (GPT2SelfAttentionLayer) + ffn (GPT2FFN), each
with its LayerNorm *inside* (atten.ln before the fused `qkv` Dense, ffn.layer_norm before ffn_1),
residual added outside.  GPT2SelfAttentionLayer: qkv split in three on the last axis, previous
key/value concatenated on the time axis, a 1/0 causal mask built in the layer from
arange_like(query) + prev_len and arange_like(key), heads reshaped (.., heads, -1),
multi_head_dot_attn (scaled by 1/sqrt(units per head), masked_softmax: where(mask, s, -1e18),
softmax, times mask), out_proj.  `compute_layout` 'NT' (batch, time, C) or 'TN' (time, batch, C)
inside the stack. Cache: hf-style: `out = model(ids, use_cache=True)`, then `model(tok,
past_key_values=out.past_key_values, use_cache=True)`; logits in `out.logits`.  The cache is
GluonNLP's own states tensor, stacked (num_layers, 2, batch, prev_len, units) for layout NT (heads
not split); prev_len is read from it.  `model.init_states(batch)` gives the empty one. Correct: no
slip.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": [
        "_backbone_model._layers.0.atten",
        "_backbone_model._layers.1.atten",
        "_backbone_model._layers.2.atten",
    ],
    "kind": "causal-multihead",
    "cache": "hf",
    "style": "GluonNLP GPT-2 port: LayerNorm inside the attention layer, fused qkv "
    "Dense split in three, 1/0 mask built in the layer from prev_len, "
    "masked_softmax (-1e18, times mask), einsum NTK attention; states "
    "stacked (L, 2, b, T, C)",
}


def multi_head_dot_attn(query, key, value, mask, layout, softmax_dim=-1):
    # query/key/value (.., heads, units_per_head) in layout NTK (b, t, h, c) or TNK (t, b, h, c)
    scale = 1.0 / math.sqrt(query.shape[-1])
    if layout == "NTK":
        scores = torch.einsum("bqhc,bkhc->bhqk", query * scale, key)
    else:
        scores = torch.einsum("qbhc,kbhc->bhqk", query * scale, key)
    mask = mask[:, None]  # (b, 1, q, k)
    scores = torch.where(mask > 0, scores, torch.full_like(scores, -1e18))
    weights = torch.softmax(scores, dim=softmax_dim) * mask
    if layout == "NTK":
        context = torch.einsum("bhqk,bkhc->bqhc", weights, value)
        return context.reshape(context.shape[0], context.shape[1], -1)
    context = torch.einsum("bhqk,kbhc->qbhc", weights, value)
    return context.reshape(context.shape[0], context.shape[1], -1)


class GPT2SelfAttentionLayer(nn.Module):
    def __init__(self, units, num_heads, layer_norm_eps, layout, strict_mask=False):
        super().__init__()
        self._units = units
        self._num_heads = num_heads
        self._layout = layout
        self._attention_layout = "NTK" if layout == "NT" else "TNK"
        self._strict_mask = strict_mask
        self.ln = nn.LayerNorm(units, eps=layer_norm_eps)
        self.qkv = nn.Linear(units, 3 * units)
        self.out_proj = nn.Linear(units, units)

    def forward(self, x, layer_states=None, prev_len=None):
        x = self.ln(x)
        time_axis = 1 if self._layout == "NT" else 0
        batch_axis = 1 - time_axis
        query, key, value = torch.chunk(self.qkv(x), 3, dim=-1)
        if layer_states is not None:
            key = torch.cat([layer_states[0], key], dim=time_axis)
            value = torch.cat([layer_states[1], value], dim=time_axis)
        query_pos = torch.arange(query.shape[time_axis], device=x.device)
        if prev_len is not None:
            query_pos = query_pos + prev_len
        key_pos = torch.arange(key.shape[time_axis], device=x.device)
        if self._strict_mask:
            mask = key_pos[None, :] < query_pos[:, None]
        else:
            mask = key_pos[None, :] <= query_pos[:, None]
        mask = mask.to(x.dtype)[None].expand(query.shape[batch_axis], -1, -1)
        q = query.reshape(query.shape[0], query.shape[1], self._num_heads, -1)
        k = key.reshape(key.shape[0], key.shape[1], self._num_heads, -1)
        v = value.reshape(value.shape[0], value.shape[1], self._num_heads, -1)
        out = multi_head_dot_attn(q, k, v, mask, self._attention_layout)
        out = self.out_proj(out)
        return out, torch.stack([key, value], dim=0)


class GPT2FFN(nn.Module):
    def __init__(self, units, hidden_size, layer_norm_eps):
        super().__init__()
        self.layer_norm = nn.LayerNorm(units, eps=layer_norm_eps)
        self.ffn_1 = nn.Linear(units, hidden_size)
        self.ffn_2 = nn.Linear(hidden_size, units)

    def forward(self, data):
        out = self.ffn_2(F.gelu(self.ffn_1(self.layer_norm(data)), approximate="tanh"))
        return out + data


class GPT2Layer(nn.Module):
    def __init__(self, cfg, layout, strict_mask):
        super().__init__()
        self.atten = GPT2SelfAttentionLayer(
            cfg.units, cfg.num_heads, cfg.layer_norm_eps, layout, strict_mask
        )
        self.ffn = GPT2FFN(cfg.units, 4 * cfg.units, cfg.layer_norm_eps)

    def forward(self, x, layer_states, prev_len):
        h, new_layer_states = self.atten(x, layer_states, prev_len)
        return self.ffn(x + h), new_layer_states


class GPT2Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self._units = cfg.units
        self._num_layers = cfg.num_layers
        self._max_length = cfg.max_length
        self._layout = "NT"
        self._compute_layout = cfg.compute_layout
        self._embed = nn.Embedding(cfg.vocab_size, cfg.units)
        self._pos_embed = nn.Embedding(cfg.max_length, cfg.units)
        self._layers = nn.ModuleList(
            [
                GPT2Layer(cfg, cfg.compute_layout, i in cfg.strict_mask_layers)
                for i in range(cfg.num_layers)
            ]
        )
        self._final_ln = nn.LayerNorm(cfg.units, eps=cfg.layer_norm_eps)
        self._freeze_states_after_prompt = cfg.freeze_states_after_prompt

    def forward(self, x, states, prev_len):
        if prev_len + x.shape[1] > self._max_length:
            raise ValueError("sequence longer than max_length")
        pos = torch.arange(x.shape[1], device=x.device) + prev_len
        h = self._embed(x) + self._pos_embed(pos)[None]
        if self._compute_layout != self._layout:
            h = h.transpose(0, 1)
        new_states = []
        for layer_idx, layer in enumerate(self._layers):
            layer_states = None if states is None else states[layer_idx]
            if layer_states is not None and self._compute_layout == "TN":
                layer_states = layer_states.transpose(1, 2)
            h, new_layer_states = layer(h, layer_states, prev_len)
            if self._compute_layout == "TN":
                new_layer_states = new_layer_states.transpose(1, 2)
            new_states.append(new_layer_states)
        h = self._final_ln(h)
        if self._compute_layout != self._layout:
            h = h.transpose(0, 1)
        new_states = torch.stack(new_states, dim=0)
        if self._freeze_states_after_prompt and prev_len > 0:
            new_states = states
        return h, new_states

    def init_states(self, batch_size, dtype=torch.float32, device=None):
        return torch.zeros(
            self._num_layers, 2, batch_size, 0, self._units, dtype=dtype, device=device
        )


class GPT2ForLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self._backbone_model = GPT2Model(cfg)

    def init_states(self, batch_size, dtype=torch.float32, device=None):
        return self._backbone_model.init_states(batch_size, dtype, device)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        states = past_key_values
        if states is not None and states.shape[2] != input_ids.shape[0]:
            raise ValueError("states were made for another batch size")
        prev_len = 0 if states is None else states.shape[3]
        contextual, new_states = self._backbone_model(input_ids, states, prev_len)
        logits = contextual @ self._backbone_model._embed.weight.t()
        return SimpleNamespace(logits=logits, past_key_values=new_states if use_cache else None)


def make_model():
    torch.manual_seed(3201)
    cfg = SimpleNamespace(
        vocab_size=96,
        units=64,
        num_heads=4,
        num_layers=3,
        max_length=64,
        layer_norm_eps=1e-5,
        compute_layout="NT",
        strict_mask_layers=(),
        freeze_states_after_prompt=False,
    )
    model = GPT2ForLM(cfg)
    g = torch.Generator().manual_seed(32011)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
            elif isinstance(m, nn.Linear):
                m.bias.copy_(0.05 * torch.randn(m.bias.shape, generator=g))
        model._backbone_model._embed.weight.normal_(0.0, 0.5, generator=g)
        model._backbone_model._pos_embed.weight.normal_(0.0, 0.5, generator=g)
    return model.eval()
