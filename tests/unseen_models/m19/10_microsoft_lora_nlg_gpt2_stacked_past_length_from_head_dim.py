"""GPT-2 from microsoft/LoRA's NLG example (examples/NLG/src/model.py with loralib's MergedLinear),
the code the LoRA paper's E2E / WebNLG numbers come from.

GPT2LMModel: transformer (GPT2Model: wte, wpe, h.N = Block(ln_1, attn, ln_2, mlp), ln_f) and lm_head
(GPT2LMHead, decoder tied to wte).  Attention: c_attn is a loralib MergedLinear (nx -> 3nx, bias) with
LoRA on q and v (enable_lora=[True, False, True], r=2, alpha 4: lora_A / lora_B added to the q and v
slices; lora_B non-zero here as after fine-tuning), c_proj a GPT-2 Conv1D.  split_heads(k=True) keeps
keys as (b, h, d, s); _attn: w = q @ k, / sqrt(d) (scale=True), causal `bias` buffer sliced
[ns-nd:ns, :ns], w = w * b - 1e10 * (1 - b), softmax, @ v.  present = torch.stack((key.transpose(-2, -1),
value)) -- one (2, b, h, s, d) tensor per layer; layer_past[0] is transposed back and keys are
concatenated on the last axis.  MHA 4 x 16, learned positions.
Cache: hf-style, one stacked tensor per layer: `out = model(ids, use_cache=True)`,
`model(tok, past_key_values=out.past_key_values, use_cache=True)`; logits in `out.logits`.
Slip: GPT2Model reads the past length as `past[0][0].size(-1)` -- written when the cached keys were
stored (b, h, d, s) as split_heads(k=True) makes them -- but `present` stores them transposed back to
(b, h, s, d), so the past length read is head_dim (16) and every decoded token gets the learned
position 16, 17, ... instead of L, L+1, ...  Mask and keys use the real lengths.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "transformer.h.0.attn",
        "transformer.h.1.attn",
        "transformer.h.2.attn",
    ],
    "kind": "causal-multihead",
    "cache": "hf",
    "decode": {
        "mistake": "cache_positions",
        "step": 0,
        "layer": "transformer.h.0.attn",
    },
    "style": "microsoft/LoRA NLG GPT-2: loralib MergedLinear c_attn with LoRA on q and v, keys split (b, h, d, s), "
    "w * b - 1e10 * (1 - b) mask, stacked (2, b, h, s, d) presents; past length read from dim -1 (head_dim) "
    "so decoded tokens get positions 16, 17, ...",
}


class Conv1D(nn.Module):
    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.1)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(*size_out)


class MergedLinear(nn.Linear):
    """loralib.MergedLinear (fan_in_fan_out=True as in the GPT-2 example), LoRA on some of q/k/v."""

    def __init__(self, in_features, out_features, r=2, lora_alpha=4, enable_lora=(True, False, True)):
        super().__init__(in_features, out_features)
        self.r = r
        self.enable_lora = list(enable_lora)
        self.scaling = lora_alpha / r
        n_on = sum(enable_lora)
        self.lora_A = nn.Parameter(torch.randn(r * n_on, in_features) * 0.1)
        self.lora_B = nn.Parameter(torch.randn(out_features // len(enable_lora) * n_on, r) * 0.1)
        self.lora_ind = torch.zeros(out_features, dtype=torch.bool).view(len(enable_lora), -1)
        self.lora_ind[self.enable_lora, :] = True
        self.lora_ind = self.lora_ind.view(-1)

    def zero_pad(self, x):
        result = x.new_zeros((*x.shape[:-1], self.out_features))
        result[..., self.lora_ind] = x
        return result

    def forward(self, x):
        result = F.linear(x, self.weight, bias=self.bias)
        after_A = F.linear(x, self.lora_A)
        after_B = F.conv1d(after_A.transpose(-2, -1), self.lora_B.unsqueeze(-1),
                           groups=sum(self.enable_lora)).transpose(-2, -1)
        return result + self.zero_pad(after_B) * self.scaling


class Attention(nn.Module):
    def __init__(self, nx, n_ctx, config, scale=False):
        super().__init__()
        n_state = nx
        self.register_buffer("bias", torch.tril(torch.ones(n_ctx, n_ctx)).view(1, 1, n_ctx, n_ctx))
        self.n_head = config.n_head
        self.split_size = n_state
        self.scale = scale
        self.c_attn = MergedLinear(nx, n_state * 3, r=config.lora_attn_dim, lora_alpha=config.lora_attn_alpha)
        self.c_proj = Conv1D(n_state, nx)

    def _attn(self, q, k, v):
        w = torch.matmul(q, k)
        if self.scale:
            w = w / math.sqrt(v.size(-1))
        nd, ns = w.size(-2), w.size(-1)
        b = self.bias[:, :, ns - nd : ns, :ns].to(w.dtype)
        w = w * b - 1e10 * (1 - b)
        w = F.softmax(w, dim=-1)
        return torch.matmul(w, v)

    def merge_heads(self, x):
        x = x.permute(0, 2, 1, 3).contiguous()
        return x.view(*x.size()[:-2], x.size(-2) * x.size(-1))

    def split_heads(self, x, k=False):
        x = x.view(*x.size()[:-1], self.n_head, x.size(-1) // self.n_head)
        if k:
            return x.permute(0, 2, 3, 1).contiguous()
        return x.permute(0, 2, 1, 3).contiguous()

    def forward(self, x, layer_past=None):
        x = self.c_attn(x)
        query, key, value = x.split(self.split_size, dim=2)
        query = self.split_heads(query)
        key = self.split_heads(key, k=True)
        value = self.split_heads(value)
        if layer_past is not None:
            past_key, past_value = layer_past[0].transpose(-2, -1), layer_past[1]
            key = torch.cat((past_key, key), dim=-1)
            value = torch.cat((past_value, value), dim=-2)
        present = torch.stack((key.transpose(-2, -1), value))
        a = self._attn(query, key, value)
        a = self.merge_heads(a)
        return self.c_proj(a), present


class MLP(nn.Module):
    def __init__(self, n_state, config):
        super().__init__()
        self.c_fc = Conv1D(n_state, config.n_embd)
        self.c_proj = Conv1D(config.n_embd, n_state)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, n_ctx, config, scale=False):
        super().__init__()
        nx = config.n_embd
        self.ln_1 = nn.LayerNorm(nx, eps=config.layer_norm_epsilon)
        self.attn = Attention(nx, n_ctx, config, scale)
        self.ln_2 = nn.LayerNorm(nx, eps=config.layer_norm_epsilon)
        self.mlp = MLP(4 * nx, config)

    def forward(self, x, layer_past=None):
        a, present = self.attn(self.ln_1(x), layer_past=layer_past)
        x = x + a
        return x + self.mlp(self.ln_2(x)), present


class GPT2Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_layer = config.n_layer
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList([Block(config.n_ctx, config, scale=True) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    def forward(self, input_ids, position_ids=None, past=None):
        if past is None:
            past_length = 0
            past = [None] * len(self.h)
        else:
            past_length = past[0][0].size(-1)
        if position_ids is None:
            position_ids = torch.arange(past_length, input_ids.size(-1) + past_length,
                                        dtype=torch.long, device=input_ids.device)
            position_ids = position_ids.unsqueeze(0).expand_as(input_ids)
        hidden_states = self.wte(input_ids) + self.wpe(position_ids)
        presents = []
        for block, layer_past in zip(self.h, past):
            hidden_states, present = block(hidden_states, layer_past=layer_past)
            presents.append(present)
        return self.ln_f(hidden_states), presents


class GPT2LMHead(nn.Module):
    def __init__(self, model_embeddings_weights):
        super().__init__()
        self.decoder_weight = model_embeddings_weights

    def forward(self, hidden_state):
        return F.linear(hidden_state, self.decoder_weight)


class GPT2LMModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transformer = GPT2Model(config)
        self.lm_head = GPT2LMHead(self.transformer.wte.weight)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden_states, presents = self.transformer(input_ids, past=past_key_values)
        return SimpleNamespace(logits=self.lm_head(hidden_states), past_key_values=presents if use_cache else None)


def make_model():
    torch.manual_seed(1910)
    config = SimpleNamespace(
        vocab_size=96, n_positions=64, n_ctx=64, n_embd=64, n_layer=3, n_head=4, layer_norm_epsilon=1e-5,
        lora_attn_dim=2, lora_attn_alpha=4,
    )
    model = GPT2LMModel(config)
    g = torch.Generator().manual_seed(19101)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
        model.transformer.wte.weight.mul_(0.3)
        model.transformer.wpe.weight.normal_(0.0, 0.5, generator=g)
        for blk in model.transformer.h:
            blk.attn.c_attn.weight.mul_(0.8)
    return model.eval()
