"""LeRobot pi0 (huggingface/lerobot, policies/pi0/paligemma_with_expert.py) style attention:
PaliGemmaWithExpertModel.forward runs each decoder layer's input_layernorm and the layer's
self_attn.q_proj/k_proj/v_proj itself, views them (*input_shape, -1, head_dim), applies the
big_vision apply_rope (x1/x2 halves split, positions [B, L]), and calls its own
eager_attention_forward (kv heads expanded [:, :, :, None, :] per group, float32 matmul,
head_dim ** -0.5, torch.where with the boolean 2-D mask from make_att_2d_masks and
big_neg = -2.3819763e38, softmax, permutes), then self_attn.o_proj. Gemma's RMSNorm scales by
(1 + weight); head_dim is decoupled from the width. Only the action-expert stream is present.

This file: one bug (GQA 8:2): kv heads expanded [:, :, None, :, :] with groups before kv heads: query head h meets kv head h % 2."""

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn


class GemmaConfig:
    hidden_size = 64
    intermediate_size = 128
    num_attention_heads = 8
    num_key_value_heads = 2
    head_dim = 16
    rms_norm_eps = 1e-6
    rope_max_wavelength = 10000
    num_hidden_layers = 1


def apply_rope(x, positions, max_wavelength=10_000):
    """
    Applies RoPE positions [B, L] to x [B, L, H, D].
    """
    d_half = x.shape[-1] // 2
    device = x.device
    dtype = x.dtype
    x = x.to(torch.float64)

    freq_exponents = (2.0 / x.shape[-1]) * torch.arange(d_half, dtype=torch.float64, device=device)
    timescale = max_wavelength**freq_exponents
    radians = positions[..., None].to(torch.float64) / timescale[None, None, :].to(torch.float64)

    radians = radians[..., None, :]

    sin = torch.sin(radians)
    cos = torch.cos(radians)

    x1, x2 = x.split(d_half, dim=-1)
    res = torch.empty_like(x)
    res[..., :d_half] = x1 * cos - x2 * sin
    res[..., d_half:] = x2 * cos + x1 * sin

    return res.to(dtype)


def make_att_2d_masks(pad_masks, att_masks):
    """Copied from big_vision: a token attends to the tokens whose cumulative att_mask is
    not greater than its own."""
    cumsum = torch.cumsum(att_masks, dim=1)
    att_2d_masks = cumsum[:, None, :] <= cumsum[:, :, None]
    pad_2d_masks = pad_masks[:, None, :] * pad_masks[:, :, None]
    return att_2d_masks & pad_2d_masks


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return out * (1.0 + self.weight)


class GemmaAttention(nn.Module):
    """Holds the projections only; the attention itself runs in PaliGemmaWithExpertModel."""

    def __init__(self, config):
        super().__init__()
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * config.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * config.head_dim, config.hidden_size, bias=False)


class GemmaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = GemmaAttention(config)
        self.mlp = GemmaMLP(config)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)


class GemmaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([GemmaDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)


class GemmaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = GemmaModel(config)


class PaliGemmaWithExpertModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.gemma_expert = GemmaForCausalLM(config)

    def eager_attention_forward(self, attention_mask, batch_size, head_dim, query_states, key_states, value_states):
        num_att_heads = self.config.num_attention_heads
        num_key_value_heads = self.config.num_key_value_heads
        num_key_value_groups = num_att_heads // num_key_value_heads

        # query_states: batch_size, sequence_length, num_att_head, head_dim
        sequence_length = key_states.shape[1]
        key_states = key_states[:, :, None, :, :].expand(
            batch_size, sequence_length, num_key_value_groups, num_key_value_heads, head_dim
        )
        key_states = key_states.reshape(
            batch_size, sequence_length, num_key_value_heads * num_key_value_groups, head_dim
        )

        value_states = value_states[:, :, None, :, :].expand(
            batch_size, sequence_length, num_key_value_groups, num_key_value_heads, head_dim
        )
        value_states = value_states.reshape(
            batch_size, sequence_length, num_key_value_heads * num_key_value_groups, head_dim
        )

        query_states = query_states.transpose(1, 2)
        key_states = key_states.transpose(1, 2)

        att_weights = torch.matmul(query_states, key_states.transpose(2, 3))
        att_weights *= head_dim**-0.5
        big_neg = -2.3819763e38  # See gemma/modules.py
        masked_att_weights = torch.where(attention_mask[:, None, :, :], att_weights, big_neg)

        probs = nn.functional.softmax(masked_att_weights, dim=-1)
        probs = probs.to(dtype=value_states.dtype)

        # probs: batch_size, num_key_value_head, num_att_head, sequence_length, sequence_length
        # value_states: batch_size, sequence_length, num_att_heads, head_dim
        att_output = torch.matmul(probs, value_states.permute(0, 2, 1, 3))
        att_output = att_output.permute(0, 2, 1, 3)
        # we use -1 because sequence length can change
        att_output = att_output.reshape(batch_size, -1, num_key_value_heads * num_key_value_groups * head_dim)
        return att_output

    def forward(self, attention_mask, position_ids, inputs_embeds):
        models = [self.gemma_expert.model]
        for layer_idx in range(self.config.num_hidden_layers):
            hidden_states = inputs_embeds
            layer = models[0].layers[layer_idx]
            residual = hidden_states
            hidden_states = layer.input_layernorm(hidden_states)
            input_shape = hidden_states.shape[:-1]
            hidden_shape = (*input_shape, -1, layer.self_attn.head_dim)

            query_states = layer.self_attn.q_proj(hidden_states).view(hidden_shape)
            key_states = layer.self_attn.k_proj(hidden_states).view(hidden_shape)
            value_states = layer.self_attn.v_proj(hidden_states).view(hidden_shape)

            query_states = apply_rope(query_states, position_ids, self.config.rope_max_wavelength)
            key_states = apply_rope(key_states, position_ids, self.config.rope_max_wavelength)

            batch_size = query_states.shape[0]
            head_dim = layer.self_attn.head_dim
            att_output = self.eager_attention_forward(
                attention_mask, batch_size, head_dim, query_states, key_states, value_states
            )
            out_emb = layer.self_attn.o_proj(att_output)
            out_emb = out_emb + residual
            after_first_residual = out_emb
            out_emb = layer.post_attention_layernorm(out_emb)
            out_emb = layer.mlp(out_emb) + after_first_residual
            inputs_embeds = out_emb
        return models[0].norm(inputs_embeds)


class PI0ActionExpert(nn.Module):
    """Suffix (action) tokens only: builds pad/att masks and positions like PI0FlowMatching."""

    def __init__(self):
        super().__init__()
        self.config = GemmaConfig()
        self.paligemma_with_expert = PaliGemmaWithExpertModel(self.config)

    def forward(self, suffix_embs):
        bsize, seq_len = suffix_embs.shape[:2]
        pad_masks = torch.ones(bsize, seq_len, dtype=torch.bool, device=suffix_embs.device)
        att_masks = torch.ones(bsize, seq_len, dtype=torch.long, device=suffix_embs.device)
        att_2d_masks = make_att_2d_masks(pad_masks, att_masks)
        position_ids = torch.cumsum(pad_masks, dim=1) - 1
        return self.paligemma_with_expert(att_2d_masks, position_ids, suffix_embs)


def make_pi0_action_expert():
    torch.manual_seed(3182)
    model = PI0ActionExpert()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, GemmaRMSNorm):
                mod.weight.uniform_(-0.5, 0.5)
    return model.eval()


EXPECT = {'target': 'make_pi0_action_expert',
 'kind': 'causal-multihead',
 'ok': False,
 'layer': 'paligemma_with_expert.gemma_expert.model.layers.0.self_attn',
 'stage': 'scores',
 'mistake': 'kv_group_mapping',
 'style': 'LeRobot pi0 PaliGemmaWithExpertModel (paligemma_with_expert.py): GQA 8:2: expand(batch, '
          'seq, groups, kv_heads, d) tiles the kv heads: query head h meets kv head h % 2'}
