"""A torch port of llama.cpp's LLaMA graph (build_llama) with GGUF tensor names and a kv_self cache.

LlamaCppModel: `token_embd`, `blk.N` (LlamaCppBlock: attn_norm, attn, ffn_norm, ffn_gate/ffn_up/
ffn_down), `output_norm`, `output`.  `blk.N.attn` holds the GGUF projections attn_q/attn_k/attn_v/
attn_output (no bias), GQA 4/2 (ggml broadcasts kv head h // 2), ggml "normal" rope mode (adjacent
pairs, freq_base 1e4), kq = k·q scaled by kq_scale = 1/sqrt(n_embd_head), kq_mask (0 / -inf, built for
n_kv columns), soft_max, kqv.
Cache: book-buffers with start_pos (n_past): `model(prompt, start_pos=0)`, `model(tok, start_pos=L)`;
or `model.reset_kv_cache()`, `model(prompt, use_cache=True)`, `model(tok, use_cache=True)`.
The kv_self buffers (batch ≤ 4, n_ctx 64, layout (b, s, kv, d)) are per attention.  `model(ids)` is
the plain causal forward; a cached call at start_pos 0 clears kv_self first.  Returns the logits tensor.
Slip (decode only): the single-token fast path (n_tokens == 1, n_past > 0) attends over
cat(kv_self[:n_past], K_cur) without ever storing K_cur/V_cur (the `llm_build_kv_store` call sits in
the batched branch only).  Step 0 is exact; at step 1 the slot of the step-0 token is still empty.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["blk.0.attn", "blk.1.attn", "blk.2.attn"],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "decode": {"mistake": "cache_stale", "step": 1, "layer": "blk.0.attn"},
    "style": "llama.cpp build_llama port with GGUF names (token_embd, blk.N.attn_q/attn_k/attn_v/attn_output, "
    "output_norm), ggml normal (adjacent-pair) rope, kv_self (b, s, kv, d) with n_past; the single-token "
    "path never stores K_cur/V_cur",
}

N_CTX = 64
N_BATCH_MAX = 4


class GGMLRMSNorm(nn.Module):
    def __init__(self, n, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def ggml_rope(x, pos, n_rot, freq_base):
    theta_scale = freq_base ** (-2.0 / n_rot)
    idx = torch.arange(n_rot // 2, dtype=torch.float64)
    theta = pos.to(torch.float64)[:, None] * theta_scale ** idx[None, :]  # (n, n_rot/2)
    c = theta.cos().to(x.dtype)[None, :, None, :]
    s = theta.sin().to(x.dtype)[None, :, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)


class LlamaCppAttention(nn.Module):
    def __init__(self, n_embd, n_head, n_head_kv, freq_base):
        super().__init__()
        self.n_head, self.n_head_kv = n_head, n_head_kv
        self.n_embd_head = n_embd // n_head
        self.freq_base = freq_base
        self.attn_q = nn.Linear(n_embd, n_head * self.n_embd_head, bias=False)
        self.attn_k = nn.Linear(n_embd, n_head_kv * self.n_embd_head, bias=False)
        self.attn_v = nn.Linear(n_embd, n_head_kv * self.n_embd_head, bias=False)
        self.attn_output = nn.Linear(n_head * self.n_embd_head, n_embd, bias=False)
        shape = (N_BATCH_MAX, N_CTX, n_head_kv, self.n_embd_head)
        self.register_buffer("k_l", torch.zeros(shape), persistent=False)
        self.register_buffer("v_l", torch.zeros(shape), persistent=False)

    def forward(self, cur, inp_pos, n_past, use_cache):
        b, n_tokens, _ = cur.shape
        hd = self.n_embd_head
        Qcur = ggml_rope(self.attn_q(cur).view(b, n_tokens, self.n_head, hd), inp_pos, hd, self.freq_base)
        Kcur = ggml_rope(self.attn_k(cur).view(b, n_tokens, self.n_head_kv, hd), inp_pos, hd, self.freq_base)
        Vcur = self.attn_v(cur).view(b, n_tokens, self.n_head_kv, hd)
        if not use_cache:
            K, V = Kcur, Vcur
        else:
            self.k_l = self.k_l.to(cur.dtype)
            self.v_l = self.v_l.to(cur.dtype)
            if n_tokens == 1 and n_past > 0:
                K = torch.cat([self.k_l[:b, :n_past], Kcur], dim=1)
                V = torch.cat([self.v_l[:b, :n_past], Vcur], dim=1)
            else:
                self.k_l[:b, n_past:n_past + n_tokens] = Kcur
                self.v_l[:b, n_past:n_past + n_tokens] = Vcur
                K = self.k_l[:b, :n_past + n_tokens]
                V = self.v_l[:b, :n_past + n_tokens]
        n_kv = K.shape[1]
        group = self.n_head // self.n_head_kv
        kv_of_head = torch.arange(self.n_head) // group
        q = Qcur.permute(0, 2, 1, 3)
        k = K.permute(0, 2, 1, 3)[:, kv_of_head]
        v = V.permute(0, 2, 1, 3)[:, kv_of_head]
        kq = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(hd))
        kv_pos = torch.arange(n_kv)
        kq_mask = torch.zeros(n_tokens, n_kv, dtype=cur.dtype).masked_fill(
            kv_pos[None, :] > inp_pos[:, None], float("-inf"))
        kq = F.softmax(kq + kq_mask, dim=-1)
        kqv = torch.matmul(kq, v).permute(0, 2, 1, 3).reshape(b, n_tokens, -1)
        return self.attn_output(kqv)


class LlamaCppBlock(nn.Module):
    def __init__(self, hp):
        super().__init__()
        self.attn_norm = GGMLRMSNorm(hp["n_embd"], hp["f_norm_rms_eps"])
        self.attn = LlamaCppAttention(hp["n_embd"], hp["n_head"], hp["n_head_kv"], hp["rope_freq_base"])
        self.ffn_norm = GGMLRMSNorm(hp["n_embd"], hp["f_norm_rms_eps"])
        self.ffn_gate = nn.Linear(hp["n_embd"], hp["n_ff"], bias=False)
        self.ffn_up = nn.Linear(hp["n_embd"], hp["n_ff"], bias=False)
        self.ffn_down = nn.Linear(hp["n_ff"], hp["n_embd"], bias=False)

    def forward(self, x, inp_pos, n_past, use_cache):
        x = x + self.attn(self.attn_norm(x), inp_pos, n_past, use_cache)
        h = self.ffn_norm(x)
        return x + self.ffn_down(F.silu(self.ffn_gate(h)) * self.ffn_up(h))


class LlamaCppModel(nn.Module):
    def __init__(self, hp):
        super().__init__()
        self.token_embd = nn.Embedding(hp["n_vocab"], hp["n_embd"])
        self.blk = nn.ModuleList([LlamaCppBlock(hp) for _ in range(hp["n_layer"])])
        self.output_norm = GGMLRMSNorm(hp["n_embd"], hp["f_norm_rms_eps"])
        self.output = nn.Linear(hp["n_embd"], hp["n_vocab"], bias=False)
        self.current_pos = 0

    def reset_kv_cache(self):
        self.current_pos = 0
        for blk in self.blk:
            blk.attn.k_l.zero_()
            blk.attn.v_l.zero_()

    def forward(self, tokens, start_pos=None, use_cache=False):
        if start_pos is not None:
            use_cache = True
        elif use_cache:
            start_pos = self.current_pos
        else:
            start_pos = 0
        n_tokens = tokens.shape[1]
        if use_cache and start_pos == 0:
            self.reset_kv_cache()  # llama_kv_cache_clear: a new sequence starts at n_past 0
        inp_pos = torch.arange(start_pos, start_pos + n_tokens)
        x = self.token_embd(tokens)
        for blk in self.blk:
            x = blk(x, inp_pos, start_pos, use_cache)
        if use_cache:
            self.current_pos = start_pos + n_tokens
        return self.output(self.output_norm(x))


def make_model():
    torch.manual_seed(1211)
    hp = dict(n_vocab=100, n_embd=64, n_head=4, n_head_kv=2, n_layer=3, n_ff=160, f_norm_rms_eps=1e-5,
              rope_freq_base=10000.0)
    model = LlamaCppModel(hp)
    g = torch.Generator().manual_seed(12111)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, GGMLRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()
