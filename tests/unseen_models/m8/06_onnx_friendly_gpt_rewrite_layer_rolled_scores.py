"""A GPT-2 style decoder rewritten to be ONNX-export friendly (the style of export-ready rewrites such
as onnxruntime's transformers tools and optimum's "export-friendly" model patches).

Export rules followed throughout: no data-dependent Python control flow, no .view(-1) on
dynamic axes (explicit reshape with shapes read from the input), a precomputed additive mask buffer
(0 / -10000.0, 64 x 64) cut with `narrow`, a fused `qkv` Linear (d, 3d) chunked with `split`, heads
moved with permute, explicit matmul (no SDPA, which older opsets cannot export), tanh GELU.
Tree: tok_embedding, pos_embedding, body.N (ExportBlock: ln_attn, self_attention, ln_mlp, mlp),
ln_out, head (untied).  MHA 4 heads of 16, learned absolute positions.
Slip: layers built with `ring_keys=True` (only body.1) keep a line from the static ring-buffer
decoder export, `torch.roll(scores, shifts=1, dims=3)`, which realigned the key axis to a write head
one slot ahead.  In the plain forward it puts q_i . k_(j-1) at key position j (position 0 gets the
last key's score): each score sits at another key's position.  Queries, keys, values, scale, mask and
softmax are untouched (the mask is added after the roll, by position).  No cache.
"""

import math

import torch
import torch.nn as nn

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["body.0.self_attention", "body.1.self_attention", "body.2.self_attention"],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "body.1.self_attention",
    "stage": "scores",
    "mistake": "wrong_key_index",
    "style": "ONNX-export-friendly GPT rewrite: fused qkv split, explicit reshape/permute, precomputed additive "
    "-10000 mask buffer cut with narrow, matmul attention, tanh GELU; body.1 rolls the scores by one key position "
    "(torch.roll(scores, 1, dims=3), a ring-buffer export leftover) before the mask",
}


class ExportSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, max_len, ring_keys=False):
        super().__init__()
        self.n_head = n_head
        self.head_size = n_embd // n_head
        self.ring_keys = ring_keys
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.out = nn.Linear(n_embd, n_embd)
        allowed = torch.tril(torch.ones(max_len, max_len))
        self.register_buffer("mask_bias", (1.0 - allowed) * -10000.0, persistent=False)
        self.register_buffer(
            "inv_scale", torch.tensor(1.0 / math.sqrt(self.head_size)), persistent=False
        )

    def forward(self, x):
        b, t, c = x.shape[0], x.shape[1], x.shape[2]
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.reshape(b, t, self.n_head, self.head_size).permute(0, 2, 1, 3)
        k = k.reshape(b, t, self.n_head, self.head_size).permute(0, 2, 1, 3)
        v = v.reshape(b, t, self.n_head, self.head_size).permute(0, 2, 1, 3)
        scores = torch.matmul(q, k.permute(0, 1, 3, 2)) * self.inv_scale.to(x.dtype)
        if self.ring_keys:
            scores = torch.roll(scores, shifts=1, dims=3)
        bias = self.mask_bias.narrow(0, 0, t).narrow(1, 0, t).to(x.dtype)
        scores = scores + bias
        probs = torch.softmax(scores, dim=-1)
        ctx = torch.matmul(probs, v).permute(0, 2, 1, 3).reshape(b, t, c)
        return self.out(ctx)


class ExportMLP(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.fc_in = nn.Linear(n_embd, 4 * n_embd)
        self.fc_out = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.fc_out(nn.functional.gelu(self.fc_in(x), approximate="tanh"))


class ExportBlock(nn.Module):
    def __init__(self, n_embd, n_head, max_len, ring_keys):
        super().__init__()
        self.ln_attn = nn.LayerNorm(n_embd)
        self.self_attention = ExportSelfAttention(n_embd, n_head, max_len, ring_keys)
        self.ln_mlp = nn.LayerNorm(n_embd)
        self.mlp = ExportMLP(n_embd)

    def forward(self, x):
        x = x + self.self_attention(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class ExportableGPT(nn.Module):
    def __init__(self, vocab=120, n_embd=64, n_head=4, n_layer=3, max_len=64, ring_layers=(1,)):
        super().__init__()
        self.tok_embedding = nn.Embedding(vocab, n_embd)
        self.pos_embedding = nn.Embedding(max_len, n_embd)
        self.body = nn.ModuleList(
            [ExportBlock(n_embd, n_head, max_len, i in ring_layers) for i in range(n_layer)]
        )
        self.ln_out = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab, bias=False)
        self.register_buffer("position_ids", torch.arange(max_len).unsqueeze(0), persistent=False)

    def forward(self, input_ids):
        t = input_ids.shape[1]
        x = self.tok_embedding(input_ids) + self.pos_embedding(self.position_ids.narrow(1, 0, t))
        for blk in self.body:
            x = blk(x)
        return self.head(self.ln_out(x))


def make_model():
    torch.manual_seed(806)
    model = ExportableGPT()
    g = torch.Generator().manual_seed(8061)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
            if isinstance(m, nn.Embedding):
                m.weight.normal_(0.0, 0.5, generator=g)
    return model.eval()
