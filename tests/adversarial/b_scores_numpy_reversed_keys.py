"""Attention scores through numpy, looping the keys from the last token backwards into slot j."""

import numpy as np
import torch


def np_scores(inputs, query_index):
    x = inputs.detach().numpy()
    q = x[query_index]
    n = len(x)
    out = np.empty(n, dtype=x.dtype)
    for j in range(n):
        out[j] = np.dot(x[n - 1 - j], q)
    return torch.from_numpy(out)


EXPECT = {
    "target": "np_scores",
    "kind": "scores",
    "ok": False,
    "stage": "scores",
    "mistake": "wrong_key_index",
}
