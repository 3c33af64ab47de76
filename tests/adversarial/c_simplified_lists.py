"""Simplified self-attention written with Python lists and math.exp (no tensor ops inside)."""

import math

import torch


def list_attention(inputs):
    if inputs.dim() == 3:
        return torch.stack([list_attention(seq) for seq in inputs])
    rows = inputs.tolist()
    out = []
    for qi in rows:
        s = [sum(a * b for a, b in zip(qi, kj)) for kj in rows]
        m = max(s)
        e = [math.exp(v - m) for v in s]
        z = sum(e)
        w = [v / z for v in e]
        out.append([sum(w[j] * rows[j][d] for j in range(len(rows))) for d in range(len(qi))])
    return torch.tensor(out, dtype=inputs.dtype)


EXPECT = {"target": "list_attention", "kind": "simplified", "ok": True}
