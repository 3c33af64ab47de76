"""CogVideoX in THUDM's SwissArmyTransformer (SAT) code (sat/dit_video_concat.py with SAT's
SelfAttention): one fused query_key_value projection cut by split_tensor_along_last_dim(..., 3),
_transpose_for_scores to [b, heads, s, head_dim], per-head query_layernorm / key_layernorm (LayerNorm
over head_dim, qk_ln=True), the 3-D rotary mixin (Rotary3DPositionEmbeddingMixin: t/h/w frequency
bands of sizes head_dim/4, 3*head_dim/8, 3*head_dim/8, each repeated pairwise '... n -> ... (n r)' and
rotated with the interleaved rotate_half '... (d r) -> ... d r'), SAT's standard_attention (query
divided by sqrt(head_dim) before the matmul, multiplicative full mask skipped when all ones, softmax,
matmul), permute back and the dense projection. Video tokens laid out as a T x 1 x 1 grid, so only
the temporal band turns; no text prefix.

This file: one bug: softmax over dim=-2 (the queries)"""

import math

import torch
from torch import nn
from torch.nn import functional as F


class CogVideoXArgs:
    hidden_size = 128
    num_attention_heads = 4
    layernorm_epsilon = 1e-5
    qk_ln = True
    rot_theta = 10000
    num_mem_kv = 0


def split_tensor_along_last_dim(tensor, num_partitions):
    last_dim = tensor.dim() - 1
    last_dim_size = tensor.size()[last_dim] // num_partitions
    return torch.split(tensor, last_dim_size, dim=last_dim)


def rotate_half(x):
    x = x.view(*x.shape[:-1], -1, 2)  # '... (d r) -> ... d r', r = 2
    x1, x2 = x.unbind(dim=-1)
    x = torch.stack((-x2, x1), dim=-1)
    return x.flatten(-2)  # '... d r -> ... (d r)'


class Rotary3DPositionEmbeddingMixin(nn.Module):
    def __init__(self, hidden_size_head, theta=10000):
        super().__init__()
        dim_t = hidden_size_head // 4
        dim_h = hidden_size_head // 8 * 3
        dim_w = hidden_size_head // 8 * 3
        self.dims = (dim_t, dim_h, dim_w)

        def band(dim):
            return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64)[: (dim // 2)] / dim))

        self.register_buffer("freqs_t", band(dim_t), persistent=False)
        self.register_buffer("freqs_h", band(dim_h), persistent=False)
        self.register_buffer("freqs_w", band(dim_w), persistent=False)

    def tables(self, num_frames, height, width, dtype):
        grid_t = torch.arange(num_frames, dtype=torch.float64)
        grid_h = torch.arange(height, dtype=torch.float64)
        grid_w = torch.arange(width, dtype=torch.float64)
        freqs_t = torch.einsum("..., f -> ... f", grid_t, self.freqs_t.to(torch.float64))
        freqs_h = torch.einsum("..., f -> ... f", grid_h, self.freqs_h.to(torch.float64))
        freqs_w = torch.einsum("..., f -> ... f", grid_w, self.freqs_w.to(torch.float64))
        freqs_t = freqs_t.repeat_interleave(2, dim=-1)  # '... n -> ... (n r)', r = 2
        freqs_h = freqs_h.repeat_interleave(2, dim=-1)
        freqs_w = freqs_w.repeat_interleave(2, dim=-1)
        freqs = torch.cat(
            (
                freqs_t[:, None, None, :].expand(-1, height, width, -1),
                freqs_h[None, :, None, :].expand(num_frames, -1, width, -1),
                freqs_w[None, None, :, :].expand(num_frames, height, -1, -1),
            ),
            dim=-1,
        )
        freqs = freqs.reshape(num_frames * height * width, -1)
        return freqs.cos().to(dtype), freqs.sin().to(dtype)

    def rotary(self, t, freqs_cos, freqs_sin):
        seq_len = t.shape[2]
        freqs_cos = freqs_cos[:seq_len].unsqueeze(0).unsqueeze(0)
        freqs_sin = freqs_sin[:seq_len].unsqueeze(0).unsqueeze(0)
        return t * freqs_cos + rotate_half(t) * freqs_sin


def standard_attention(query_layer, key_layer, value_layer, attention_mask, scaling_attention_score=True):
    if scaling_attention_score:
        query_layer = query_layer / math.sqrt(query_layer.shape[-1])
    attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
    if not (attention_mask.shape[-2] == 1 and (attention_mask > 0).all()):
        attention_scores = torch.mul(attention_scores, attention_mask) - 10000.0 * (1.0 - attention_mask)
    attention_probs = F.softmax(attention_scores, dim=-2)
    context_layer = torch.einsum("bhij,bhjd->bhid", attention_probs, value_layer)
    return context_layer


class SelfAttention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.hidden_size = args.hidden_size
        self.num_attention_heads = args.num_attention_heads
        self.hidden_size_per_attention_head = args.hidden_size // args.num_attention_heads
        self.num_attention_heads_per_partition = args.num_attention_heads
        self.hidden_size_per_partition = args.hidden_size
        self.query_key_value = nn.Linear(args.hidden_size, 3 * args.hidden_size, bias=True)
        self.dense = nn.Linear(args.hidden_size, args.hidden_size, bias=True)
        self.qk_ln = args.qk_ln
        if self.qk_ln:
            self.query_layernorm = nn.LayerNorm(self.hidden_size_per_attention_head, eps=1e-6)
            self.key_layernorm = nn.LayerNorm(self.hidden_size_per_attention_head, eps=1e-6)
        self.rope_mixin = Rotary3DPositionEmbeddingMixin(
            self.hidden_size_per_attention_head, theta=args.rot_theta
        )
        self.num_mem_kv = args.num_mem_kv
        if self.num_mem_kv > 0:
            shape = (self.num_attention_heads, self.num_mem_kv, self.hidden_size_per_attention_head)
            self.mem_k = nn.Parameter(torch.randn(shape))
            self.mem_v = nn.Parameter(torch.randn(shape))

    def _transpose_for_scores(self, tensor):
        new_tensor_shape = tensor.size()[:-1] + (
            self.num_attention_heads_per_partition,
            self.hidden_size_per_attention_head,
        )
        tensor = tensor.view(*new_tensor_shape)
        return tensor.permute(0, 2, 1, 3)

    def forward(self, hidden_states, mask, rope_tables):
        mixed_raw_layer = self.query_key_value(hidden_states)
        (mixed_query_layer, mixed_key_layer, mixed_value_layer) = split_tensor_along_last_dim(
            mixed_raw_layer, 3
        )
        query_layer = self._transpose_for_scores(mixed_query_layer)
        key_layer = self._transpose_for_scores(mixed_key_layer)
        value_layer = self._transpose_for_scores(mixed_value_layer)

        if self.qk_ln:
            query_layer = self.query_layernorm(query_layer)
            key_layer = self.key_layernorm(key_layer)

        freqs_cos, freqs_sin = rope_tables
        query_layer = self.rope_mixin.rotary(query_layer, freqs_cos, freqs_sin)
        key_layer = self.rope_mixin.rotary(key_layer, freqs_cos, freqs_sin)

        if self.num_mem_kv > 0:
            b = key_layer.shape[0]
            mem_k = self.mem_k.to(key_layer.dtype)[None].expand(b, -1, -1, -1)
            mem_v = self.mem_v.to(value_layer.dtype)[None].expand(b, -1, -1, -1)
            key_layer = torch.cat((mem_k, key_layer), dim=2)
            value_layer = torch.cat((mem_v, value_layer), dim=2)

        context_layer = standard_attention(query_layer, key_layer, value_layer, mask)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        new_context_layer_shape = context_layer.size()[:-2] + (self.hidden_size_per_partition,)
        context_layer = context_layer.view(*new_context_layer_shape)
        return self.dense(context_layer)


class BaseTransformerLayer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(args.hidden_size, eps=args.layernorm_epsilon)
        self.attention = SelfAttention(args)
        self.post_attention_layernorm = nn.LayerNorm(args.hidden_size, eps=args.layernorm_epsilon)
        self.mlp_up = nn.Linear(args.hidden_size, 4 * args.hidden_size)
        self.mlp_down = nn.Linear(4 * args.hidden_size, args.hidden_size)

    def forward(self, hidden_states, mask, rope_tables):
        attention_output = self.attention(self.input_layernorm(hidden_states), mask, rope_tables)
        hidden_states = hidden_states + attention_output
        mlp = self.mlp_down(F.gelu(self.mlp_up(self.post_attention_layernorm(hidden_states)), approximate="tanh"))
        return hidden_states + mlp


class DiffusionTransformer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.layers = nn.ModuleList([BaseTransformerLayer(args)])
        self.final_layernorm = nn.LayerNorm(args.hidden_size, eps=args.layernorm_epsilon)

    def forward(self, video_tokens):
        num_frames = video_tokens.shape[1]
        mask = torch.ones(1, 1, dtype=video_tokens.dtype, device=video_tokens.device)
        rope_tables = self.layers[0].attention.rope_mixin.tables(num_frames, 1, 1, video_tokens.dtype)
        hidden_states = video_tokens
        for layer in self.layers:
            hidden_states = layer(hidden_states, mask, rope_tables)
        return self.final_layernorm(hidden_states)


def make_cogvideox_sat():
    torch.manual_seed(2752)
    args = CogVideoXArgs()
    model = DiffusionTransformer(args)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm) and mod.elementwise_affine:
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_cogvideox_sat",
    "kind": "multihead",
    "ok": False,
    "layer": "layers.0.attention",
    "stage": "weights",
    "mistake": "softmax_wrong_dim",
    "style": "CogVideoX SAT SelfAttention: standard_attention softmax(dim=-2)",
}
