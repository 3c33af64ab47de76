"""LeRobot SmolVLA (huggingface/lerobot, policies/smolvla/smolvlm_with_expert.py) style
cross-attention layer of the action expert (attention_mode="cross_attn"): the expert's queries
come from its own input_layernorm'd hidden states through self_attn.q_proj; keys and values are
the VLM's key/value states for the prefix, flattened to (*shape[:2], -1) and re-projected by the
expert's own self_attn.k_proj / v_proj (whose in_features are the VLM's kv width), then the same
eager_attention_forward as pi0 (kv heads expanded [:, :, :, None, :] per group, head_dim ** -0.5,
torch.where with a boolean mask, softmax, permutes) and o_proj. In this layer the expert tokens
see every prefix token (the mask is all True); no rotary is applied here (the VLM states given
to it are taken as they are).

This file: correct (cross-attention of the action expert to the VLM states, GQA 4:2, head_dim 16, no rotary in this layer)."""

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn


class ExpertConfig:
    hidden_size = 64
    vlm_kv_width = 64
    num_attention_heads = 4
    num_key_value_heads = 2
    head_dim = 16
    rms_norm_eps = 1e-5
    intermediate_size = 128


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class ExpertAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(config.vlm_kv_width, config.num_key_value_heads * config.head_dim, bias=False)
        self.v_proj = nn.Linear(config.vlm_kv_width, config.num_key_value_heads * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * config.head_dim, config.hidden_size, bias=False)


class ExpertLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = ExpertAttention(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([ExpertLayer(config)])


class SmolVLMWithExpertModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = ExpertConfig()
        self.lm_expert = LlamaModel(self.config)

    def eager_attention_forward(self, attention_mask, batch_size, head_dim, query_states, key_states, value_states):
        num_att_heads = self.config.num_attention_heads
        num_key_value_heads = self.config.num_key_value_heads
        num_key_value_groups = num_att_heads // num_key_value_heads

        sequence_length = key_states.shape[1]
        key_states = key_states[:, :, :, None, :].expand(
            batch_size, sequence_length, num_key_value_heads, num_key_value_groups, head_dim
        )
        key_states = key_states.reshape(
            batch_size, sequence_length, num_key_value_heads * num_key_value_groups, head_dim
        )
        value_states = value_states[:, :, :, None, :].expand(
            batch_size, sequence_length, num_key_value_heads, num_key_value_groups, head_dim
        )
        value_states = value_states.reshape(
            batch_size, sequence_length, num_key_value_heads * num_key_value_groups, head_dim
        )
        query_states = query_states.transpose(1, 2)
        key_states = key_states.transpose(1, 2)
        att_weights = torch.matmul(query_states, key_states.transpose(2, 3))
        att_weights *= head_dim**-0.5
        big_neg = torch.finfo(att_weights.dtype).min
        masked_att_weights = torch.where(attention_mask[:, None, :, :], att_weights, big_neg)
        probs = nn.functional.softmax(masked_att_weights, dim=-1)
        probs = probs.to(dtype=value_states.dtype)
        att_output = torch.matmul(probs, value_states.permute(0, 2, 1, 3))
        att_output = att_output.permute(0, 2, 1, 3)
        att_output = att_output.reshape(batch_size, -1, num_key_value_heads * num_key_value_groups * head_dim)
        return att_output

    def forward(self, expert_hidden, vlm_kv_states):
        expert_layer = self.lm_expert.layers[0]
        residual = expert_hidden
        expert_hidden = expert_layer.input_layernorm(expert_hidden)
        expert_input_shape = expert_hidden.shape[:-1]
        expert_hidden_shape = (*expert_input_shape, -1, expert_layer.self_attn.head_dim)
        expert_query_states = expert_layer.self_attn.q_proj(expert_hidden).view(expert_hidden_shape)

        _key_states = vlm_kv_states.view(*vlm_kv_states.shape[:2], -1)
        expert_key_states = expert_layer.self_attn.k_proj(_key_states).view(
            *_key_states.shape[:-1], -1, expert_layer.self_attn.head_dim
        )
        _value_states = vlm_kv_states.view(*vlm_kv_states.shape[:2], -1)
        expert_value_states = expert_layer.self_attn.v_proj(_value_states).view(
            *_value_states.shape[:-1], -1, expert_layer.self_attn.head_dim
        )
        batch_size, expert_len = expert_query_states.shape[:2]
        prefix_len = expert_key_states.shape[1]
        attention_mask = torch.ones(batch_size, expert_len, prefix_len, dtype=torch.bool, device=expert_hidden.device)
        att_output = self.eager_attention_forward(
            attention_mask, batch_size, expert_layer.self_attn.head_dim,
            expert_query_states, expert_key_states, expert_value_states,
        )
        return residual + expert_layer.self_attn.o_proj(att_output)


def make_smolvla_cross_expert():
    torch.manual_seed(3056)
    model = SmolVLMWithExpertModel()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, LlamaRMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {'target': 'make_smolvla_cross_expert',
 'kind': 'cross',
 'ok': True,
 'layer': 'lm_expert.layers.0.self_attn',
 'structure': {'heads': 4,
               'kv_heads': 2,
               'head_dim': 16,
               'causal': False,
               'cross': True,
               'rope': None,
               'qk_norm': None,
               'window': None,
               'bias': None},
 'style': 'LeRobot SmolVLA expert cross-attention (smolvlm_with_expert.py): correct '
          '(cross-attention, GQA 4:2 by the [:, :, :, None, :] expand, keys/values re-projected '
          'from the VLM states)'}
