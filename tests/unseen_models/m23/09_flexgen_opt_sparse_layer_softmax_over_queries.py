"""FlexGen's OPT (FMInference/FlexGen flex_opt.py + pytorch_backend.py) with one sparse-attention layer.

Same OptLM as a plain FlexGen run: flat `layers` list [InputEmbed, SelfAttention, MLP, ..., OutputEmbed]
(attention at `layers.1`, `layers.3`, `layers.5`), raw `w_q`/`b_q`... tensors, offset-2 positions from
cumsum(mask), `mha` with (b*n_head, s, d) queries, (b*n_head, d, s) keys, where(mask, w, -1e4),
sequence-first (s, b*n_head, d) cache for `mha_gen`.  FlexGen's SelfAttention also applies the layer
norm and adds the residual; here OptLM does both around the call (`w_ln`/`b_ln` stay on the module).
The policy gives the last decoder layer `attn_sparsity` 0.5, so it is built as `SparseSelfAttention`,
whose prompt path keeps the attention weights in their 4-D (b, n_head, s, s) view for the top-k
bookkeeping.
Slip: that path still calls `F.softmax(attn_weights, dim=2)`, the axis that was the key axis in the
3-D (b*n_head, s, s) view but is the query axis in the 4-D one: layer `layers.5` normalises every key
column over the queries.  Layers 1 and 3 are plain SelfAttention.
Cache: book-buffers (`reset_kv_cache()` + `use_cache=True`), as in a plain run; the decode path is the
plain `mha_gen` in every layer.
"""


from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["layers.1", "layers.3", "layers.5"],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "layer": "layers.5",
    "stage": "weights",
    "mistake": "softmax_wrong_dim",
    "style": "FlexGen flex_opt.py OptLM (flat layers list, raw w_q/b_q tensors, (b*n_head, d, s) keys, -1e4 where-mask, "
    "sequence-first cache); the last layer is a SparseSelfAttention (attn_sparsity 0.5) whose 4-D weights are "
    "softmaxed over dim=2, the query axis",
}


def _p(*shape, scale=1.0):
    return nn.Parameter(torch.randn(*shape) * scale)


class InputEmbed(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.w_token = _p(config.vocab_size, config.input_dim, scale=0.5)
        self.w_pos = _p(config.max_seq_len + 2, config.input_dim, scale=0.5)

    def forward(self, inputs, attention_mask):
        token_embed = F.embedding(inputs, self.w_token)
        past_key_values_length = attention_mask.shape[1] - inputs.shape[1]
        positions = torch.cumsum(attention_mask.int(), dim=1).int() * attention_mask.int() + 1
        positions = positions[:, past_key_values_length:]
        pos_embed = F.embedding(positions.long(), self.w_pos)
        return token_embed + pos_embed


class OutputEmbed(nn.Module):
    def __init__(self, config, input_embed):
        super().__init__()
        self.w_ln = nn.Parameter(torch.ones(config.input_dim))
        self.b_ln = nn.Parameter(torch.zeros(config.input_dim))
        self._input_embed = [input_embed]

    def forward(self, hidden):
        hidden = F.layer_norm(hidden, (hidden.shape[-1],), weight=self.w_ln, bias=self.b_ln)
        return F.linear(hidden, self._input_embed[0].w_token)


class SelfAttention(nn.Module):
    def __init__(self, config, layer_id):
        super().__init__()
        h = config.input_dim
        self.layer_id = layer_id
        self.n_head = config.n_head
        self.head_dim = h // config.n_head
        self.scaling = self.head_dim**-0.5
        s = h**-0.5
        self.w_q, self.b_q = _p(h, h, scale=s), _p(h, scale=0.1)
        self.w_k, self.b_k = _p(h, h, scale=s), _p(h, scale=0.1)
        self.w_v, self.b_v = _p(h, h, scale=s), _p(h, scale=0.1)
        self.w_out, self.b_out = _p(h, h, scale=s), _p(h, scale=0.1)
        self.w_ln = nn.Parameter(torch.ones(h))
        self.b_ln = nn.Parameter(torch.zeros(h))
        self.cache_home = None

    def init_cache_one_gpu_batch(self, max_len=64, max_batch=4, dtype=torch.float32):
        shape = (max_len, max_batch * self.n_head, self.head_dim)
        self.cache_home = (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))

    def layer_norm(self, inputs):
        return F.layer_norm(inputs, (inputs.shape[-1],), weight=self.w_ln, bias=self.b_ln)

    def forward(self, hidden, attention_mask, i=0):
        if self.cache_home is not None and self.cache_home[0].dtype != hidden.dtype:
            self.cache_home = tuple(c.to(hidden.dtype) for c in self.cache_home)
        if i == 0 or self.cache_home is None:
            value, k, v = self.mha(hidden, attention_mask)
            if self.cache_home is not None:
                s = k.shape[0]
                bn = k.shape[1]
                self.cache_home[0][:s, :bn] = k
                self.cache_home[1][:s, :bn] = v
        else:
            value, k_new, v_new = self.mha_gen(hidden, attention_mask, self.cache_home)
            src_s = attention_mask.shape[1]
            bn = k_new.shape[1]
            self.cache_home[0][src_s - 1 : src_s, :bn] = k_new
            self.cache_home[1][src_s - 1 : src_s, :bn] = v_new
        return value

    def mha(self, inputs, attention_mask):
        b, s, h = inputs.shape
        n_head, head_dim = self.n_head, self.head_dim
        q = F.linear(inputs, self.w_q, bias=self.b_q) * self.scaling
        k = F.linear(inputs, self.w_k, bias=self.b_k)
        v = F.linear(inputs, self.w_v, bias=self.b_v)
        q = q.view(b, s, n_head, head_dim)
        k = k.view(b, s, n_head, head_dim)
        v = v.view(b, s, n_head, head_dim)
        # shape: (b * n_head, s, head_dim)
        q = q.permute(0, 2, 1, 3).reshape(b * n_head, s, head_dim)
        # shape: (b * n_head, head_dim, s)
        k = k.permute(0, 2, 3, 1).reshape(b * n_head, head_dim, s)
        # shape: (b * n_head, s, head_dim)
        v = v.permute(0, 2, 1, 3).reshape(b * n_head, s, head_dim)
        attn_weights = torch.bmm(q, k)
        idx = torch.arange(s, device=inputs.device)
        causal_mask = (idx <= idx.view(s, 1)).view(1, 1, s, s)
        mask = attention_mask.view(b, 1, 1, s) & causal_mask
        attn_weights = attn_weights.view(b, n_head, s, s)
        attn_weights = torch.where(mask, attn_weights, torch.tensor(-1e4, dtype=attn_weights.dtype))
        attn_weights = attn_weights.view(b * n_head, s, s)
        attn_weights = F.softmax(attn_weights, dim=2)
        value = torch.bmm(attn_weights, v).view(b, n_head, s, head_dim)
        value = value.transpose(1, 2).reshape(b, s, h)
        value = F.linear(value, self.w_out, bias=self.b_out)
        # (s, b * n_head, head_dim)
        k = k.permute(2, 0, 1)
        v = v.permute(1, 0, 2)
        return value, k, v

    def mha_gen(self, inputs, attention_mask, cache):
        b, tgt_s, h = inputs.shape
        src_s = attention_mask.shape[1]
        n_head, head_dim = self.n_head, self.head_dim
        q = F.linear(inputs, self.w_q, bias=self.b_q) * self.scaling
        k = F.linear(inputs, self.w_k, bias=self.b_k)
        v = F.linear(inputs, self.w_v, bias=self.b_v)
        q = q.view(b, tgt_s, n_head, head_dim).permute(0, 2, 1, 3).reshape(b * n_head, tgt_s, head_dim)
        k_new = k.view(b, tgt_s, n_head, head_dim).permute(0, 2, 3, 1).reshape(b * n_head, head_dim, tgt_s)
        v_new = v.view(b, tgt_s, n_head, head_dim).permute(0, 2, 1, 3).reshape(b * n_head, tgt_s, head_dim)
        k_cache, v_cache = cache
        k = k_cache[:src_s, : b * n_head].clone()
        v = v_cache[:src_s, : b * n_head].clone()
        k[src_s - 1 : src_s] = k_new.permute(2, 0, 1)
        v[src_s - 1 : src_s] = v_new.permute(1, 0, 2)
        k = k.permute(1, 2, 0).reshape(b * n_head, head_dim, src_s)
        v = v.permute(1, 0, 2).reshape(b * n_head, src_s, head_dim)
        value = self._attention_value(q, k, v, attention_mask, b, src_s, tgt_s, n_head, head_dim)
        value = value.transpose(1, 2).view(b, tgt_s, h)
        value = F.linear(value, self.w_out, bias=self.b_out)
        return value, k_new.permute(2, 0, 1), v_new.permute(1, 0, 2)

    def _attention_weights(self, q, k, mask, b, src_s, n_head):
        attn_weights = torch.bmm(q, k)
        mask = mask.view(b, 1, 1, src_s)
        attn_weights = attn_weights.view(b, n_head, 1, src_s)
        attn_weights = torch.where(mask, attn_weights, torch.tensor(-1e4, dtype=attn_weights.dtype))
        attn_weights = attn_weights.view(b * n_head, 1, src_s)
        return F.softmax(attn_weights, dim=2)

    def _attention_value(self, q, k, v, mask, b, src_s, tgt_s, n_head, head_dim):
        attn_weights = self._attention_weights(q, k, mask, b, src_s, n_head)
        return torch.bmm(attn_weights, v).view(b, n_head, tgt_s, head_dim)


class SparseSelfAttention(SelfAttention):
    """attn_sparsity < 1: the prompt path keeps the weights 4-D for the top-k selection."""

    def __init__(self, config, layer_id, attn_sparsity):
        super().__init__(config, layer_id)
        self.attn_sparsity = attn_sparsity

    def mha(self, inputs, attention_mask):
        b, s, h = inputs.shape
        n_head, head_dim = self.n_head, self.head_dim
        q = F.linear(inputs, self.w_q, bias=self.b_q) * self.scaling
        k = F.linear(inputs, self.w_k, bias=self.b_k)
        v = F.linear(inputs, self.w_v, bias=self.b_v)
        q = q.view(b, s, n_head, head_dim).permute(0, 2, 1, 3).reshape(b * n_head, s, head_dim)
        k = k.view(b, s, n_head, head_dim).permute(0, 2, 3, 1).reshape(b * n_head, head_dim, s)
        v = v.view(b, s, n_head, head_dim).permute(0, 2, 1, 3).reshape(b * n_head, s, head_dim)
        attn_weights = torch.bmm(q, k)
        idx = torch.arange(s, device=inputs.device)
        causal_mask = (idx <= idx.view(s, 1)).view(1, 1, s, s)
        mask = attention_mask.view(b, 1, 1, s) & causal_mask
        attn_weights = attn_weights.view(b, n_head, s, s)
        attn_weights = torch.where(mask, attn_weights, torch.tensor(-1e4, dtype=attn_weights.dtype))
        attn_weights = F.softmax(attn_weights, dim=2)
        value = torch.matmul(attn_weights, v.view(b, n_head, s, head_dim))
        value = value.transpose(1, 2).reshape(b, s, h)
        value = F.linear(value, self.w_out, bias=self.b_out)
        return value, k.permute(2, 0, 1), v.permute(1, 0, 2)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        h, f = config.input_dim, config.ffn_embed_dim
        self.wi, self.bi = _p(f, h, scale=h**-0.5), _p(f, scale=0.1)
        self.wo, self.bo = _p(h, f, scale=f**-0.5), _p(h, scale=0.1)
        self.w_ln = nn.Parameter(torch.ones(h))
        self.b_ln = nn.Parameter(torch.zeros(h))

    def forward(self, inputs):
        out = F.layer_norm(inputs, (inputs.shape[-1],), weight=self.w_ln, bias=self.b_ln)
        out = F.relu(F.linear(out, self.wi, bias=self.bi))
        out = F.linear(out, self.wo, bias=self.bo)
        return out + inputs


class OptLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        layers = [InputEmbed(config)]
        for i in range(config.num_hidden_layers):
            sparsity = config.attn_sparsity[i]
            if sparsity < 1.0:
                layers.append(SparseSelfAttention(config, i, sparsity))
            else:
                layers.append(SelfAttention(config, i))
            layers.append(MLP(config))
        layers.append(OutputEmbed(config, layers[0]))
        self.layers = nn.ModuleList(layers)
        self.attention_mask = None
        self._cached = False

    def reset_kv_cache(self):
        self.attention_mask = None
        self._cached = True
        dtype = self.layers[0].w_token.dtype
        for layer in self.layers:
            if isinstance(layer, SelfAttention):
                layer.init_cache_one_gpu_batch(dtype=dtype)

    def update_attention_mask(self, inputs):
        b, s = inputs.shape
        if self.attention_mask is None:
            self.attention_mask = torch.ones(b, s, dtype=torch.bool, device=inputs.device)
            return 0
        self.attention_mask = torch.cat(
            [self.attention_mask, torch.ones(b, s, dtype=torch.bool, device=inputs.device)], dim=1
        )
        return 1

    def forward(self, input_ids, use_cache=False):
        if use_cache:
            if not self._cached:
                self.reset_kv_cache()
            i = self.update_attention_mask(input_ids)
            mask = self.attention_mask
        else:
            i = 0
            mask = torch.ones(input_ids.shape, dtype=torch.bool, device=input_ids.device)
        hidden = None
        for layer in self.layers:
            if isinstance(layer, InputEmbed):
                hidden = layer(input_ids, mask)
            elif isinstance(layer, SelfAttention):
                saved = layer.cache_home
                if not use_cache:
                    layer.cache_home = None
                hidden = hidden + layer(layer.layer_norm(hidden), mask, i)
                layer.cache_home = saved
            else:
                hidden = layer(hidden)
        return hidden


def make_model():
    torch.manual_seed(2309)
    config = SimpleNamespace(
        vocab_size=96, input_dim=64, n_head=4, ffn_embed_dim=128, num_hidden_layers=3, max_seq_len=64,
        attn_sparsity=(1.0, 1.0, 0.5),
    )
    model = OptLM(config)
    g = torch.Generator().manual_seed(23091)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("w_ln"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("b_ln"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()
