"""LightLLM BLOOM (ModelTC/lightllm, models/bloom): the serving engine's layer-infer style. Weights live
as pre-transposed tensors (q_weight_, k_weight_, v_weight_, o_weight_ and biases) applied with
torch.addmm on a flat [total_tokens, hidden] batch; requests are located by infer_state.b_start_loc /
b_seq_len; the prefill attention (context_attention_fwd, a Triton kernel upstream, written here as a
torch loop with the same arithmetic) scales q.k by 1/sqrt(head_dim), subtracts the ALiBi term
(query_pos - key_pos) * slope with the tp_alibi slopes, masks the future with -inf and softmaxes;
BLOOM's input_layernorm / post_attention_layernorm and GELU MLP around it.

This file: one bug: the causal mask is applied to the probabilities after the softmax (zeroed, not renormalised)"""

import math

import torch
from torch import nn
from torch.nn import functional as F


class BloomConfig:
    hidden_size = 64
    n_head = 8
    layer_norm_epsilon = 1e-5
    talking_heads = False


def get_slopes(n):
    def get_slopes_power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        ratio = start
        return [start * ratio**i for i in range(n)]

    if math.log2(n).is_integer():
        return get_slopes_power_of_2(n)
    closest_power_of_2 = 2 ** math.floor(math.log2(n))
    return (
        get_slopes_power_of_2(closest_power_of_2)
        + get_slopes(2 * closest_power_of_2)[0::2][: n - closest_power_of_2]
    )


def generate_alibi(n_head):
    return torch.tensor(get_slopes(n_head), dtype=torch.float64)


class InferStateInfo:
    def __init__(self, batch_size, seq_len, device):
        self.batch_size = batch_size
        self.total_token_num = batch_size * seq_len
        self.max_len_in_batch = seq_len
        self.b_seq_len = torch.full((batch_size,), seq_len, dtype=torch.int32, device=device)
        self.b_start_loc = torch.arange(batch_size, dtype=torch.int32, device=device) * seq_len
        self.is_prefill = True


def context_attention_fwd(q, k, v, o, b_start_loc, b_seq_len, alibi, sm_scale, head_mix=None):
    """q, k, v, o: [total_tokens, heads, head_dim]; alibi: [heads]."""
    batch = b_seq_len.shape[0]
    for cur_batch in range(batch):
        start = int(b_start_loc[cur_batch])
        cur_len = int(b_seq_len[cur_batch])
        qi = q[start : start + cur_len].transpose(0, 1)  # [heads, len, head_dim]
        ki = k[start : start + cur_len].transpose(0, 1)
        vi = v[start : start + cur_len].transpose(0, 1)
        offs_m = torch.arange(cur_len, device=q.device)[:, None]
        offs_n = torch.arange(cur_len, device=q.device)[None, :]
        qk = torch.matmul(qi, ki.transpose(-1, -2)) * sm_scale
        alibi_loc = (offs_m - offs_n).to(qk.dtype)
        qk = qk - alibi_loc[None] * alibi[:, None, None]
        if head_mix is not None:
            qk = torch.einsum("hij,hg->gij", qk, head_mix[0])
        p = torch.softmax(qk, dim=-1)
        p = p.masked_fill(offs_m < offs_n, 0.0)
        if head_mix is not None:
            p = torch.einsum("hij,hg->gij", p, head_mix[1])
        o[start : start + cur_len] = torch.matmul(p, vi).transpose(0, 1)
    return o


class BloomAttentionInfer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_dim_ = config.hidden_size
        self.tp_q_head_num_ = config.n_head
        self.head_dim_ = config.hidden_size // config.n_head
        bound = 1.0 / math.sqrt(self.embed_dim_)
        for name in ("q", "k", "v", "o"):
            w = torch.empty(self.embed_dim_, self.embed_dim_).uniform_(-bound, bound)
            b = torch.empty(self.embed_dim_).uniform_(-bound, bound)
            setattr(self, f"{name}_weight_", nn.Parameter(w))
            setattr(self, f"{name}_bias_", nn.Parameter(b))
        self.register_buffer("tp_alibi", generate_alibi(self.tp_q_head_num_), persistent=False)
        self.talking_heads = config.talking_heads
        if self.talking_heads:
            n = self.tp_q_head_num_
            self.pre_softmax_proj = nn.Parameter(torch.eye(n) + 0.3 * torch.randn(n, n))
            self.post_softmax_proj = nn.Parameter(torch.eye(n) + 0.3 * torch.randn(n, n))

    def _get_qkv(self, input, infer_state):
        q = torch.addmm(self.q_bias_, input.view(-1, self.embed_dim_), self.q_weight_)
        k = torch.addmm(self.k_bias_, input.view(-1, self.embed_dim_), self.k_weight_)
        v = torch.addmm(self.v_bias_, input.view(-1, self.embed_dim_), self.v_weight_)
        return q, k, v

    def _context_attention_kernel(self, q, k, v, infer_state):
        o_tensor = torch.empty_like(q)
        head_mix = None
        if self.talking_heads:
            head_mix = (self.pre_softmax_proj, self.post_softmax_proj)
        context_attention_fwd(
            q.view(-1, self.tp_q_head_num_, self.head_dim_),
            k.view(-1, self.tp_q_head_num_, self.head_dim_),
            v.view(-1, self.tp_q_head_num_, self.head_dim_),
            o_tensor.view(-1, self.tp_q_head_num_, self.head_dim_),
            infer_state.b_start_loc,
            infer_state.b_seq_len,
            self.tp_alibi.to(q.dtype),
            1.0 / math.sqrt(self.head_dim_),
            head_mix=head_mix,
        )
        return o_tensor

    def _get_o(self, input, infer_state):
        return torch.addmm(self.o_bias_, input.view(-1, self.embed_dim_), self.o_weight_)

    def forward(self, input_embdings, infer_state):
        q, k, v = self._get_qkv(input_embdings, infer_state)
        o = self._context_attention_kernel(q, k, v, infer_state)
        return self._get_o(o, infer_state)


class BloomTransformerLayerInfer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.self_attn = BloomAttentionInfer(config)
        self.post_attention_layernorm = nn.LayerNorm(
            config.hidden_size, eps=config.layer_norm_epsilon
        )
        self.ffn_up = nn.Linear(config.hidden_size, 4 * config.hidden_size)
        self.ffn_down = nn.Linear(4 * config.hidden_size, config.hidden_size)

    def forward(self, input_embdings, infer_state):
        input1 = self.input_layernorm(input_embdings)
        input_embdings = input_embdings + self.self_attn(input1, infer_state)
        input1 = self.post_attention_layernorm(input_embdings)
        ffn = self.ffn_down(F.gelu(self.ffn_up(input1), approximate="tanh"))
        return input_embdings + ffn


class BloomTpPartModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([BloomTransformerLayerInfer(config)])
        self.final_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, input_embs):
        batch_size, seq_len, hidden = input_embs.shape
        infer_state = InferStateInfo(batch_size, seq_len, input_embs.device)
        x = input_embs.reshape(batch_size * seq_len, hidden)
        for layer in self.layers:
            x = layer(x, infer_state)
        return self.final_layernorm(x).view(batch_size, seq_len, hidden)


def make_lightllm_bloom():
    torch.manual_seed(2726)
    config = BloomConfig()
    model = BloomTpPartModel(config)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_lightllm_bloom",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "layers.0.self_attn",
    "stage": "weights",
    "mistake": "mask_after_softmax",
    "style": "LightLLM BLOOM layer infer: softmax over all keys, future probabilities zeroed afterwards",
}
