"""Cerebras-GPT (HF GPT2Attention) with reorder_and_upcast_attn=True and
scale_attn_by_inverse_layer_idx=True at layer_idx 0: Conv1D c_attn split, _split_heads, heads folded
into the batch for torch.baddbmm(empty, q, k^T, beta=0, alpha=scale_factor), bool tril buffer with
torch.where(finfo.min), softmax, matmul, _merge_heads, c_proj. Standalone layer; returns a tuple.

This file: one bug, the folded operands are built from key and query swapped."""

import torch
from torch import nn


class GPT2Config:
    """Cerebras-GPT checkpoints are GPT-2 configs; this one turns on the reordered/upcast path."""

    n_embd = 64
    n_head = 4
    n_positions = 128
    scale_attn_weights = True
    scale_attn_by_inverse_layer_idx = True
    reorder_and_upcast_attn = True


class Conv1D(nn.Module):
    """GPT-2's transposed linear: weight is (nx, nf)."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.12)
        self.bias = nn.Parameter(torch.randn(nf) * 0.05)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class GPT2Attention(nn.Module):
    def __init__(self, config, layer_idx=None):
        super().__init__()
        max_positions = config.n_positions
        self.register_buffer(
            "bias",
            torch.tril(torch.ones((max_positions, max_positions), dtype=torch.bool)).view(
                1, 1, max_positions, max_positions
            ),
            persistent=False,
        )
        self.embed_dim = config.n_embd
        self.num_heads = config.n_head
        self.head_dim = self.embed_dim // self.num_heads
        self.split_size = self.embed_dim
        self.scale_attn_weights = config.scale_attn_weights
        self.scale_attn_by_inverse_layer_idx = config.scale_attn_by_inverse_layer_idx
        self.layer_idx = layer_idx
        self.reorder_and_upcast_attn = config.reorder_and_upcast_attn
        self.c_attn = Conv1D(3 * self.embed_dim, self.embed_dim)
        self.c_proj = Conv1D(self.embed_dim, self.embed_dim)

    def _upcast_and_reordered_attn(self, query, key, value, attention_mask=None):
        bsz, num_heads, q_seq_len, dk = query.size()
        _, _, k_seq_len, _ = key.size()
        # upcast half precision only; float64 probes stay in float64
        upcast = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
        attn_weights = torch.empty(
            bsz * num_heads, q_seq_len, k_seq_len, dtype=upcast, device=query.device
        )

        scale_factor = 1.0
        if self.scale_attn_weights:
            scale_factor /= float(value.size(-1)) ** 0.5
        if self.scale_attn_by_inverse_layer_idx:
            scale_factor /= float(self.layer_idx + 1)

        q, k = key.reshape(-1, k_seq_len, dk), query.transpose(-1, -2).reshape(-1, dk, q_seq_len)
        attn_weights = torch.baddbmm(
            attn_weights, q.to(upcast), k.to(upcast), beta=0, alpha=scale_factor
        )
        attn_weights = attn_weights.reshape(bsz, num_heads, q_seq_len, k_seq_len)

        query_length, key_length = query.size(-2), key.size(-2)
        causal_mask = self.bias[:, :, key_length - query_length : key_length, :key_length]
        mask_value = torch.finfo(attn_weights.dtype).min
        mask_value = torch.tensor(mask_value, dtype=attn_weights.dtype, device=attn_weights.device)
        attn_weights = torch.where(causal_mask, attn_weights, mask_value)

        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask

        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_weights = attn_weights.type(value.dtype)
        attn_output = torch.matmul(attn_weights, value)
        return attn_output, attn_weights

    def _split_heads(self, tensor, num_heads, attn_head_size):
        new_shape = tensor.size()[:-1] + (num_heads, attn_head_size)
        tensor = tensor.view(new_shape)
        return tensor.permute(0, 2, 1, 3)  # (batch, head, seq_length, head_features)

    def _merge_heads(self, tensor, num_heads, attn_head_size):
        tensor = tensor.permute(0, 2, 1, 3).contiguous()
        new_shape = tensor.size()[:-2] + (num_heads * attn_head_size,)
        return tensor.view(new_shape)

    def forward(
        self,
        hidden_states,
        layer_past=None,
        attention_mask=None,
        use_cache=False,
        output_attentions=False,
    ):
        query, key, value = self.c_attn(hidden_states).split(self.split_size, dim=2)
        query = self._split_heads(query, self.num_heads, self.head_dim)
        key = self._split_heads(key, self.num_heads, self.head_dim)
        value = self._split_heads(value, self.num_heads, self.head_dim)

        if layer_past is not None:
            past_key, past_value = layer_past
            key = torch.cat((past_key, key), dim=-2)
            value = torch.cat((past_value, value), dim=-2)
        present = (key, value) if use_cache else None

        if self.reorder_and_upcast_attn:
            attn_output, attn_weights = self._upcast_and_reordered_attn(
                query, key, value, attention_mask
            )
        else:
            raise NotImplementedError("only the reordered/upcast path is ported here")

        attn_output = self._merge_heads(attn_output, self.num_heads, self.head_dim)
        attn_output = self.c_proj(attn_output)
        outputs = (attn_output, present)
        if output_attentions:
            outputs += (attn_weights,)
        return outputs


def make_cerebras_attention():
    torch.manual_seed(1441)
    return GPT2Attention(GPT2Config(), layer_idx=0).eval()


EXPECT = {
    "target": "make_cerebras_attention",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "",
    "stage": "scores",
    "mistake": "scores_transposed",
    "style": "GPT2 _upcast_and_reordered_attn: q, k built as key.reshape(...), query^T.reshape(...), the"
    " baddbmm computes keys times queries",
}
