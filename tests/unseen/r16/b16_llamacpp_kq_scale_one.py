"""llama.cpp's graph builder ported to torch: GGUF tensor names (`wq`, `wk`, `wv`, `wo`, `attn_q_norm`,
`attn_k_norm`), `ggml_rope_ext` with NORM (consecutive pairs) or NEOX (halves) mode and `n_rot`
rotated dims, `build_attn_mha` with `ggml_permute` and kv-head broadcasting, `ggml_soft_max_ext(kq,
kq_mask, kq_scale, max_bias)`, a `kq_mask` filled per (query, cell) as `set_input_kq_mask` does
(causal `p0 > p1`, SWA `p1 - p0 >= n_swa`); each sequence of the batch runs as its own ubatch.

This file: one bug: the fallback for `f_attention_scale == 0` is 1.0 instead of
1/sqrt(n_embd_head_k), so no scale is applied."""

import math

import torch
from torch import nn

LLAMA_ROPE_TYPE_NORM = 0
LLAMA_ROPE_TYPE_NEOX = 2

class llama_hparams:
    n_embd = 64
    n_head = 4
    n_head_kv = 2
    n_embd_head_k = 16
    n_rot = 16
    rope_type = LLAMA_ROPE_TYPE_NEOX
    rope_freq_base_train = 1000000.0
    f_norm_rms_eps = 1e-6
    n_swa = 0
    f_attention_scale = 0.0
    f_max_alibi_bias = 0.0

def ggml_rope_ext(x, pos, n_dims, mode, freq_base):
    """x: [n_tokens, n_head, head_dim]. NORM mode rotates consecutive pairs (x[2i], x[2i+1]),
    NEOX mode pairs x[i] with x[i + n_dims/2]; dims past n_dims pass through."""
    half = n_dims // 2
    theta_scale = freq_base ** (-2.0 / n_dims)
    inv = theta_scale ** torch.arange(half, dtype=torch.float64, device=x.device)
    theta = pos.to(torch.float64)[:, None] * inv[None, :]
    cos = theta.cos().to(x.dtype)[:, None, :]
    sin = theta.sin().to(x.dtype)[:, None, :]
    rot, rest = x[..., :n_dims], x[..., n_dims:]
    if mode == LLAMA_ROPE_TYPE_NEOX:
        x0, x1 = rot[..., :half], rot[..., half:]
        out = torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    else:
        x0, x1 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    return torch.cat((out, rest), dim=-1)

def ggml_soft_max_ext(kq, mask, scale, max_bias):
    """softmax(kq * scale + slope * mask) over the last axis; max_bias 0 gives slope 1."""
    assert max_bias == 0.0
    return torch.softmax(kq * scale + mask, dim=-1)

def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

class llama_layer(nn.Module):
    """One layer's attention tensors, named as in the GGUF file (blk.N.attn_*)."""

    def __init__(self, hp):
        super().__init__()
        d = hp.n_embd_head_k
        self.wq = nn.Linear(hp.n_embd, hp.n_head * d, bias=False)
        self.wk = nn.Linear(hp.n_embd, hp.n_head_kv * d, bias=False)
        self.wv = nn.Linear(hp.n_embd, hp.n_head_kv * d, bias=False)
        self.wo = nn.Linear(hp.n_head * d, hp.n_embd, bias=False)
        self.attn_q_norm = nn.Parameter(torch.ones(d))
        self.attn_k_norm = nn.Parameter(torch.ones(d))

    def build_attn(self, cur, inp_pos, kq_mask, hp):
        """llm_build_*: Qcur/Kcur/Vcur -> (qk norm) -> ggml_rope_ext -> build_attn_mha."""
        n_tokens = cur.shape[0]
        d = hp.n_embd_head_k
        Qcur = self.wq(cur).view(n_tokens, hp.n_head, d)
        Kcur = self.wk(cur).view(n_tokens, hp.n_head_kv, d)
        Vcur = self.wv(cur).view(n_tokens, hp.n_head_kv, d)
        Qcur = rms_norm(Qcur, self.attn_q_norm, hp.f_norm_rms_eps)
        Kcur = rms_norm(Kcur, self.attn_k_norm, hp.f_norm_rms_eps)
        Qcur = ggml_rope_ext(Qcur, inp_pos, hp.n_rot, hp.rope_type, hp.rope_freq_base_train)
        Kcur = ggml_rope_ext(Kcur, inp_pos, hp.n_rot, hp.rope_type, hp.rope_freq_base_train)

        kq_scale = 1.0 if hp.f_attention_scale == 0.0 else hp.f_attention_scale
        return self.build_attn_mha(Qcur, Kcur, Vcur, kq_mask, kq_scale, hp)

    def build_attn_mha(self, q, k, v, kq_mask, kq_scale, hp):
        # ggml_permute(q, 0, 2, 1, 3): heads outermost
        q = q.permute(1, 0, 2)
        k = k.permute(1, 0, 2)
        v = v.permute(1, 0, 2)
        # ggml_mul_mat broadcasts the kv heads over the query heads: head h uses kv head h / (n_head / n_head_kv)
        n_rep = hp.n_head // hp.n_head_kv
        k = k.repeat_interleave(n_rep, dim=0)
        v = v.repeat_interleave(n_rep, dim=0)
        kq = torch.matmul(q, k.transpose(-1, -2))
        kq = ggml_soft_max_ext(kq, kq_mask, kq_scale, hp.f_max_alibi_bias)
        kqv = torch.matmul(kq, v)
        cur = kqv.permute(1, 0, 2).reshape(q.shape[1], hp.n_head * hp.n_embd_head_k)
        return self.wo(cur)

class llama_context(nn.Module):
    """Runs each sequence of the batch as its own ubatch (positions 0..n-1, empty KV cache) and
    fills kq_mask the way llama_kv_cache::set_input_kq_mask does."""

    def __init__(self, hp):
        super().__init__()
        self.hp = hp
        self.layers = nn.ModuleList([llama_layer(hp)])

    def kq_mask(self, n_tokens, dtype, device):
        mask = torch.zeros(n_tokens, n_tokens, dtype=dtype, device=device)
        for i in range(n_tokens):          # query token at position p1
            p1 = i
            for j in range(n_tokens):      # kv cell at position p0
                p0 = j
                masked = p0 > p1
                if self.hp.n_swa > 0:
                    masked = masked or (p1 - p0 >= self.hp.n_swa)
                if masked:
                    mask[i, j] = float("-inf")
        return mask

    def forward(self, batch_embd):
        outs = []
        for embd in batch_embd:
            n_tokens = embd.shape[0]
            inp_pos = torch.arange(n_tokens, device=embd.device)
            kq_mask = self.kq_mask(n_tokens, embd.dtype, embd.device)
            cur = embd
            for layer in self.layers:
                cur = layer.build_attn(cur, inp_pos, kq_mask, self.hp)
            outs.append(cur)
        return torch.stack(outs, dim=0)

def make_llamacpp_qwen3():
    torch.manual_seed(1636)
    ctx = llama_context(llama_hparams())
    with torch.no_grad():
        for layer in ctx.layers:
            layer.attn_q_norm.uniform_(0.5, 1.5)
            layer.attn_k_norm.uniform_(0.5, 1.5)
    return ctx.eval()


EXPECT = {
    "target": "make_llamacpp_qwen3",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "layers.0",
    "stage": "scaled_scores",
    "mistake": "missing_scale",
    "style": "llama.cpp Qwen3 port: kq_scale falls back to 1.0 instead of 1/sqrt(head_dim)"
}
