"""ggml's examples/gpt-2 (main.cpp `gpt2_eval`) ported to torch, tensor names kept.

gpt2_model: `wte`, `wpe`, `layers.N` (gpt2_layer holding raw parameters `ln_1_g`/`ln_1_b`,
`c_attn_attn_w`/`c_attn_attn_b` (fused qkv, (3 * n_embd, n_embd)), `c_attn_proj_w`/`c_attn_proj_b`,
`ln_2_g`/`ln_2_b`, `c_mlp_fc_w`/`c_mlp_fc_b`, `c_mlp_proj_w`/`c_mlp_proj_b`), `ln_f_g`/`ln_f_b`, and
`lm_head` tied to wte.  The attention is computed inside the layer (ggml builds one graph), so the
attention layer is `layers.N`.  Per layer: Qcur/Kcur/Vcur are views of the fused qkv at offsets 0,
n_embd, 2 * n_embd; KQ = K^T Q per head, ggml_scale by 1/sqrt(n_embd/n_head), ggml_diag_mask_inf with
n_past, soft_max, KQV, merge heads, c_attn_proj.  Learned positions wpe[n_past + i].  MHA 4 x 16.
The KV memory is ggml's: `memory_k` / `memory_v`, one flat token-major row of n_embd per (layer,
position) (here one per sequence too: (n_layer, batch, n_ctx, n_embd)); the prompt (n_past == 0) is
evaluated from Kcur/Vcur directly while it is stored.
Cache: book-buffers: `model.reset_kv_cache()`, `model(prompt, use_cache=True)`, `model(tok, use_cache=True)`
(batch <= 4, 64 positions).  `model(ids)` is the full forward and touches no memory.  Returns the logits
tensor.
Slip: when n_past > 0, K is read back from memory_k with the example's
reshape (n_past + N, n_head, hd) -> permute (head, pos, hd), but V is read with the layout of the
transposed V cache of later ggml code (`v_trans`): memory_v's rows are reshaped straight to
(n_head, n_past + N, hd) without the permute, so every head reads scrambled values.  The keys, the mask
and the positions are right; the prompt pass and the full forward are exact.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "layers.0",
        "layers.1",
        "layers.2",
    ],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "decode": {
        "mistake": "cache_other",
        "step": 0,
        "layer": "layers.0",
    },
    "style": "ggml examples/gpt-2 gpt2_eval port: raw ln_1_g / c_attn_attn_w / c_attn_proj_w ... parameters per layer, "
    "fused qkv views, scale 1/sqrt(hd), diag_mask_inf(n_past), flat token-major memory_k/memory_v; slip: decode reads "
    "memory_v reshaped head-major without the permute",
}


class GPT2Layer(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_embd, self.n_head = n_embd, n_head
        self.ln_1_g = nn.Parameter(torch.ones(n_embd))
        self.ln_1_b = nn.Parameter(torch.zeros(n_embd))
        self.ln_2_g = nn.Parameter(torch.ones(n_embd))
        self.ln_2_b = nn.Parameter(torch.zeros(n_embd))
        self.c_attn_attn_w = nn.Parameter(torch.randn(3 * n_embd, n_embd) * 0.12)
        self.c_attn_attn_b = nn.Parameter(torch.randn(3 * n_embd) * 0.02)
        self.c_attn_proj_w = nn.Parameter(torch.randn(n_embd, n_embd) * 0.12)
        self.c_attn_proj_b = nn.Parameter(torch.randn(n_embd) * 0.02)
        self.c_mlp_fc_w = nn.Parameter(torch.randn(4 * n_embd, n_embd) * 0.12)
        self.c_mlp_fc_b = nn.Parameter(torch.zeros(4 * n_embd))
        self.c_mlp_proj_w = nn.Parameter(torch.randn(n_embd, 4 * n_embd) * 0.06)
        self.c_mlp_proj_b = nn.Parameter(torch.zeros(n_embd))

    def forward(self, inpL, n_past, memory_k=None, memory_v=None):
        B, N, n_embd = inpL.shape
        n_head = self.n_head
        hd = n_embd // n_head
        cur = F.layer_norm(inpL, (n_embd,), self.ln_1_g, self.ln_1_b, 1e-5)
        cur = F.linear(cur, self.c_attn_attn_w, self.c_attn_attn_b)
        Qcur = cur[..., 0 * n_embd : 1 * n_embd]
        Kcur = cur[..., 1 * n_embd : 2 * n_embd]
        Vcur = cur[..., 2 * n_embd : 3 * n_embd]
        if memory_k is not None:
            memory_k[:B, n_past : n_past + N] = Kcur
            memory_v[:B, n_past : n_past + N] = Vcur
        Q = Qcur.reshape(B, N, n_head, hd).permute(0, 2, 1, 3)
        if memory_k is not None and n_past > 0:
            K = memory_k[:B, : n_past + N].reshape(B, n_past + N, n_head, hd).permute(0, 2, 1, 3)
            V = memory_v[:B, : n_past + N].reshape(B, n_head, n_past + N, hd)
        else:
            K = Kcur.reshape(B, N, n_head, hd).permute(0, 2, 1, 3)
            V = Vcur.reshape(B, N, n_head, hd).permute(0, 2, 1, 3)
        KQ = torch.matmul(Q, K.transpose(-1, -2))
        KQ_scaled = KQ * (1.0 / math.sqrt(float(n_embd) / n_head))
        n_kv = K.shape[2]
        rows = torch.arange(N, device=inpL.device)[:, None] + n_past
        cols = torch.arange(n_kv, device=inpL.device)[None, :]
        KQ_masked = KQ_scaled.masked_fill(cols > rows, float("-inf"))
        KQ_soft_max = torch.softmax(KQ_masked, dim=-1)
        KQV = torch.matmul(KQ_soft_max, V)
        cur = KQV.permute(0, 2, 1, 3).reshape(B, N, n_embd)
        cur = F.linear(cur, self.c_attn_proj_w, self.c_attn_proj_b)
        inpFF = cur + inpL
        cur = F.layer_norm(inpFF, (n_embd,), self.ln_2_g, self.ln_2_b, 1e-5)
        cur = F.gelu(F.linear(cur, self.c_mlp_fc_w, self.c_mlp_fc_b), approximate="tanh")
        cur = F.linear(cur, self.c_mlp_proj_w, self.c_mlp_proj_b)
        return cur + inpFF


class GPT2Model(nn.Module):
    def __init__(self, n_vocab=96, n_ctx=64, n_embd=64, n_head=4, n_layer=3):
        super().__init__()
        self.n_ctx, self.n_embd, self.n_layer = n_ctx, n_embd, n_layer
        self.wte = nn.Parameter(torch.randn(n_vocab, n_embd) * 0.5)
        self.wpe = nn.Parameter(torch.randn(n_ctx, n_embd) * 0.5)
        self.layers = nn.ModuleList([GPT2Layer(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f_g = nn.Parameter(torch.ones(n_embd))
        self.ln_f_b = nn.Parameter(torch.zeros(n_embd))
        self.max_batch = 4
        self.memory_k = None
        self.memory_v = None
        self.n_past = 0

    def reset_kv_cache(self):
        self.memory_k = None
        self.memory_v = None
        self.n_past = 0

    def forward(self, embd_inp, use_cache=False):
        B, N = embd_inp.shape
        n_past = self.n_past if use_cache else 0
        if use_cache and self.memory_k is None:
            shape = (self.n_layer, self.max_batch, self.n_ctx, self.n_embd)
            self.memory_k = torch.zeros(shape, dtype=self.wte.dtype, device=self.wte.device)
            self.memory_v = torch.zeros(shape, dtype=self.wte.dtype, device=self.wte.device)
        position = torch.arange(n_past, n_past + N, device=embd_inp.device)
        inpL = self.wte[embd_inp] + self.wpe[position][None]
        for il, layer in enumerate(self.layers):
            mk = self.memory_k[il] if use_cache else None
            mv = self.memory_v[il] if use_cache else None
            inpL = layer(inpL, n_past, mk, mv)
        if use_cache:
            self.n_past = n_past + N
        inpL = F.layer_norm(inpL, (self.n_embd,), self.ln_f_g, self.ln_f_b, 1e-5)
        return F.linear(inpL, self.wte)


def make_model():
    torch.manual_seed(1813)
    model = GPT2Model()
    g = torch.Generator().manual_seed(18131)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_g"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith(("ln_1_b", "ln_2_b", "ln_f_b")):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()
