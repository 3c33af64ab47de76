"""JonasGeiping/cramming crammed-BERT (cramming/architectures/crammed_bert.py + components.py + attention.py).

ScriptableLMForPreTraining: encoder (ScriptableLM: embedding = EmbeddingComponent with word_embedding,
learned pos_embedding and a LayerNorm `norm`; layers.N = TransformerLayer, pre-norm: norm1 -> attn ->
+ residual, norm2 -> ffn (FFNComponent: dense_in, GLU gelu, dense_out) -> + residual; final_norm),
prediction_head (dense, gelu, LayerNorm) and decoder.  The encoder runs sequence-first: hidden states
are transposed to [s, b, h] before the layers and back afterwards.  attn = AttentionComponent:
self_attention (SeqFirstSelfAttention: one query_key_value Linear viewed (s, b, heads, 3*hd) and split
per head into q, k, v; scores with torch.baddbmm(beta=0, alpha=norm_factor) on (b*h, s, d); softmax;
bmm with the values) followed by the component's `dense` output projection.  Bidirectional, MHA 4x16.
Slip: the attention was ported with Megatron's query-key layer scaling: norm_factor =
1 / (sqrt(hd) * layer_number) with layer_number = index + 1, but the matching "softmax scale = coeff"
that undoes it was dropped.  Layer 0 (coeff 1) is exact; from layer 1 on the scores are divided by an
extra 2, 3: layer 1 is the first wrong layer (scale 1/(2*sqrt(16)) = 1/8 instead of 1/4).
No cache.  Returns the MLM logits tensor.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["encoder.layers.0.attn", "encoder.layers.1.attn", "encoder.layers.2.attn"],
    "kind": "multihead",
    "cache": None,
    "layer": "encoder.layers.1.attn",
    "stage": "scaled_scores",
    "mistake": "wrong_scale",
    "style": "cramming crammed-BERT: sequence-first [s, b, h] layers, AttentionComponent = SeqFirstSelfAttention "
    "(query_key_value viewed (s, b, h, 3d) split per head, baddbmm alpha=norm_factor) + dense, pre-norm, GLU ffn, "
    "learned positions; Megatron query-key layer scaling kept without the softmax coeff: scale 1/(sqrt(d)*(i+1))",
}


class SeqFirstSelfAttention(nn.Module):
    def __init__(self, hidden_size, num_attention_heads, layer_number, apply_query_key_layer_scaling):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.hidden_per_head = hidden_size // num_attention_heads
        self.query_key_value = nn.Linear(hidden_size, 3 * hidden_size, bias=True)
        coeff = layer_number if apply_query_key_layer_scaling else 1
        self.norm_factor = 1.0 / (math.sqrt(self.hidden_per_head) * coeff)

    def attention(self, query_layer, key_layer, value_layer, attention_mask=None):
        # [sq, b, np, hn]
        output_size = (query_layer.size(1), query_layer.size(2), query_layer.size(0), key_layer.size(0))
        query_layer = query_layer.view(output_size[2], output_size[0] * output_size[1], -1)
        key_layer = key_layer.view(output_size[3], output_size[0] * output_size[1], -1)
        matmul_result = torch.empty(
            output_size[0] * output_size[1], output_size[2], output_size[3],
            dtype=query_layer.dtype, device=query_layer.device,
        )
        matmul_result = torch.baddbmm(
            matmul_result,
            query_layer.transpose(0, 1),
            key_layer.transpose(0, 1).transpose(1, 2),
            beta=0.0,
            alpha=self.norm_factor,
        )
        attention_scores = matmul_result.view(*output_size)
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask
        attention_probs = torch.softmax(attention_scores, dim=-1)
        output_size = (value_layer.size(1), value_layer.size(2), query_layer.size(0), value_layer.size(3))
        value_layer = value_layer.view(value_layer.size(0), output_size[0] * output_size[1], -1)
        attention_probs = attention_probs.view(output_size[0] * output_size[1], output_size[2], -1)
        context_layer = torch.bmm(attention_probs, value_layer.transpose(0, 1))
        context_layer = context_layer.view(*output_size)
        return context_layer

    def forward(self, hidden_states, attention_mask=None):
        mixed_x_layer = self.query_key_value(hidden_states)
        new_shape = mixed_x_layer.size()[:-1] + (self.num_attention_heads, 3 * self.hidden_per_head)
        mixed_x_layer = mixed_x_layer.view(new_shape)
        query_layer, key_layer, value_layer = torch.split(mixed_x_layer, [self.hidden_per_head] * 3, dim=3)
        context_layer = self.attention(query_layer, key_layer, value_layer, attention_mask)
        # [b, np, sq, hn] -> [sq, b, np, hn] -> [sq, b, hp]
        context_layer = context_layer.permute(2, 0, 1, 3).contiguous()
        return context_layer.view(context_layer.size()[:-2] + (self.hidden_size,))


class AttentionComponent(nn.Module):
    def __init__(self, idx, hidden_size, cfg_attention):
        super().__init__()
        self.self_attention = SeqFirstSelfAttention(
            hidden_size, cfg_attention.num_attention_heads, idx + 1, cfg_attention.query_key_layer_scaling
        )
        self.dense = nn.Linear(hidden_size, hidden_size, bias=True)

    def forward(self, hidden_states, attention_mask=None):
        return self.dense(self.self_attention(hidden_states, attention_mask))


class FFNComponent(nn.Module):
    def __init__(self, hidden_size, intermed_size):
        super().__init__()
        self.dense_in = nn.Linear(hidden_size, intermed_size * 2, bias=True)
        self.dense_out = nn.Linear(intermed_size, hidden_size, bias=True)

    def forward(self, hidden_states):
        x, gate = self.dense_in(hidden_states).chunk(2, dim=-1)
        return self.dense_out(F.gelu(gate) * x)


class TransformerLayer(nn.Module):
    def __init__(self, idx, cfg_arch):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg_arch.hidden_size, eps=cfg_arch.norm_eps)
        self.norm2 = nn.LayerNorm(cfg_arch.hidden_size, eps=cfg_arch.norm_eps)
        self.attn = AttentionComponent(idx, cfg_arch.hidden_size, cfg_arch.attention)
        self.ffn = FFNComponent(cfg_arch.hidden_size, cfg_arch.intermed_size)

    def forward(self, states, attention_mask=None):
        states = states + self.attn(self.norm1(states), attention_mask)
        return states + self.ffn(self.norm2(states))


class EmbeddingComponent(nn.Module):
    def __init__(self, cfg_arch):
        super().__init__()
        self.word_embedding = nn.Embedding(cfg_arch.vocab_size, cfg_arch.hidden_size)
        self.pos_embedding = nn.Embedding(cfg_arch.max_seq_length, cfg_arch.hidden_size)
        self.norm = nn.LayerNorm(cfg_arch.hidden_size, eps=cfg_arch.norm_eps)

    def forward(self, input_ids):
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.norm(self.word_embedding(input_ids) + self.pos_embedding(pos)[None])


class ScriptableLM(nn.Module):
    def __init__(self, cfg_arch):
        super().__init__()
        self.embedding = EmbeddingComponent(cfg_arch)
        self.layers = nn.ModuleList([TransformerLayer(idx, cfg_arch) for idx in range(cfg_arch.num_transformer_layers)])
        self.seq_first = True
        self.final_norm = nn.LayerNorm(cfg_arch.hidden_size, eps=cfg_arch.norm_eps)

    def forward(self, input_ids, attention_mask=None):
        hidden_states = self.embedding(input_ids)
        ext_mask = None
        if attention_mask is not None:
            ext_mask = (1.0 - attention_mask[:, None, None, :].to(hidden_states.dtype)) * -10000.0
        if self.seq_first:
            hidden_states = hidden_states.transpose(0, 1).contiguous()
        for layer_module in self.layers:
            hidden_states = layer_module(hidden_states, ext_mask)
        if self.seq_first:
            hidden_states = hidden_states.transpose(0, 1).contiguous()
        return self.final_norm(hidden_states)


class PredictionHeadComponent(nn.Module):
    def __init__(self, cfg_arch):
        super().__init__()
        self.dense = nn.Linear(cfg_arch.hidden_size, cfg_arch.hidden_size)
        self.norm = nn.LayerNorm(cfg_arch.hidden_size, eps=cfg_arch.norm_eps)

    def forward(self, x):
        return self.norm(F.gelu(self.dense(x)))


class ScriptableLMForPreTraining(nn.Module):
    def __init__(self, cfg_arch):
        super().__init__()
        self.encoder = ScriptableLM(cfg_arch)
        self.prediction_head = PredictionHeadComponent(cfg_arch)
        self.decoder = nn.Linear(cfg_arch.hidden_size, cfg_arch.vocab_size, bias=True)

    def forward(self, input_ids, attention_mask=None):
        return self.decoder(self.prediction_head(self.encoder(input_ids, attention_mask)))


def make_model():
    torch.manual_seed(1708)
    cfg_arch = SimpleNamespace(
        vocab_size=96,
        hidden_size=64,
        intermed_size=128,
        num_transformer_layers=3,
        max_seq_length=64,
        norm_eps=1e-12,
        attention=SimpleNamespace(num_attention_heads=4, query_key_layer_scaling=True),
    )
    model = ScriptableLMForPreTraining(cfg_arch)
    g = torch.Generator().manual_seed(17081)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()
