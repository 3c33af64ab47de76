"""Jay Mody's picoGPT ('GPT in 60 lines of NumPy') ported to torch: parameters in picoGPT's nested
dict layout (ParameterDicts of w/b with (in, out) weights), linear = x @ w + b, mha() chunks the
fused c_attn output into q/k/v and each into heads, a list comprehension runs attention() per head
with the (1 - tri) * -1e10 causal mask, hstack merges, c_proj; the module loops over the batch
because picoGPT works on one sequence. Pre-LN block inside gpt2() with learned wpe.

This file: one bug, the softmax denominator is not shifted like the numerator."""

import math

import torch
from torch import nn


# ---- picoGPT's numpy helpers, ported one-for-one to torch ----------------------------------------


def gelu(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def softmax(x, axis=-1):
    exp_x = torch.exp(x - torch.amax(x, dim=axis, keepdim=True))
    return exp_x / torch.sum(torch.exp(x), dim=axis, keepdim=True)


def layer_norm(x, g, b, eps: float = 1e-5):
    mean = torch.mean(x, dim=-1, keepdim=True)
    variance = torch.var(x, dim=-1, keepdim=True, unbiased=False)
    x = (x - mean) / torch.sqrt(variance + eps)
    return g * x + b


def linear(x, w, b):  # [m, in], [in, out], [out] -> [m, out]
    return x @ w + b


def ffn(x, c_fc, c_proj):
    a = gelu(linear(x, **c_fc))
    return linear(a, **c_proj)


def attention(q, k, v, mask):  # [n_q, d_k], [n_k, d_k], [n_k, d_v], [n_q, n_k] -> [n_q, d_v]
    return softmax(q @ k.T / math.sqrt(q.shape[-1]) + mask) @ v


def mha(x, c_attn, c_proj, n_head):  # [n_seq, n_embd] -> [n_seq, n_embd]
    x = linear(x, **c_attn)  # [n_seq, 3 * n_embd]
    qkv = torch.chunk(x, 3, dim=-1)  # np.split(x, 3, axis=-1)
    qkv_heads = [torch.chunk(part, n_head, dim=-1) for part in qkv]  # 3 x n_head x [n_seq, hd]
    n_seq = x.shape[0]
    causal_mask = (1 - torch.tril(torch.ones(n_seq, n_seq, dtype=x.dtype))) * -1e10
    out_heads = [attention(q, k, v, causal_mask) for q, k, v in zip(*qkv_heads)]
    x = torch.hstack(out_heads)  # [n_seq, n_embd]
    return linear(x, **c_proj)


# ---- the torch wrapper: parameters kept in picoGPT's nested-dict layout ----------------------------


def _param_dict(**tensors):
    return nn.ParameterDict({k: nn.Parameter(v) for k, v in tensors.items()})


class PicoAttention(nn.Module):
    """mha() over a batch: picoGPT works on one [n_seq, n_embd] sequence, so loop over the batch."""

    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.c_attn = _param_dict(
            w=torch.randn(n_embd, 3 * n_embd) * 0.15, b=torch.randn(3 * n_embd) * 0.05
        )
        self.c_proj = _param_dict(
            w=torch.randn(n_embd, n_embd) * 0.15, b=torch.randn(n_embd) * 0.05
        )

    def forward(self, x):
        c_attn, c_proj = dict(self.c_attn.items()), dict(self.c_proj.items())
        return torch.stack([mha(seq, c_attn, c_proj, self.n_head) for seq in x.unbind(0)])


class PicoBlock(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1 = _param_dict(g=torch.rand(n_embd) + 0.5, b=torch.randn(n_embd) * 0.1)
        self.attn = PicoAttention(n_embd, n_head)
        self.ln_2 = _param_dict(g=torch.rand(n_embd) + 0.5, b=torch.randn(n_embd) * 0.1)
        self.mlp = nn.ModuleDict(
            {
                "c_fc": _param_dict(
                    w=torch.randn(n_embd, 4 * n_embd) * 0.1, b=torch.zeros(4 * n_embd)
                ),
                "c_proj": _param_dict(
                    w=torch.randn(4 * n_embd, n_embd) * 0.1, b=torch.zeros(n_embd)
                ),
            }
        )

    def forward(self, x):
        x = x + self.attn(layer_norm(x, **dict(self.ln_1.items())))
        mlp = {k: dict(v.items()) for k, v in self.mlp.items()}
        return x + ffn(layer_norm(x, **dict(self.ln_2.items())), **mlp)


class PicoGPT2(nn.Module):
    """gpt2(inputs, wte, wpe, blocks, ln_f, n_head) with the token lookup replaced by float inputs."""

    def __init__(self, n_embd=64, n_head=4, n_layer=1, n_ctx=64):
        super().__init__()
        self.wpe = nn.Parameter(torch.randn(n_ctx, n_embd) * 0.02)
        self.blocks = nn.ModuleList([PicoBlock(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = _param_dict(g=torch.rand(n_embd) + 0.5, b=torch.randn(n_embd) * 0.1)

    def forward(self, x):
        x = x + self.wpe[: x.shape[1]]
        for block in self.blocks:
            x = block(x)
        return layer_norm(x, **dict(self.ln_f.items()))


def make_picogpt():
    torch.manual_seed(1401)
    return PicoGPT2().eval()


EXPECT = {
    "target": "make_picogpt",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "blocks.0.attn",
    "stage": "weights",
    "mistake": "not_softmax",
    "style": "picoGPT port softmax helper: exp(x - max) divided by sum(exp(x)) (the unshifted sum), rows"
    " sum to exp(-max)",
}
