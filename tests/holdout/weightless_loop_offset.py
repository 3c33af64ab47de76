"""Weightless attention with a double loop whose inner range starts at 1."""

import torch


def attend(X):
    T = X.shape[0]
    S = torch.zeros(T, T, dtype=X.dtype)
    for r in range(T):
        for c in range(1, T):
            S[r, c - 1] = X[r].dot(X[c])
    A = torch.softmax(S, dim=1)
    return A @ X


EXPECT = {
    "target": "attend",
    "kind": "simplified",
    "ok": False,
    "stage": "scores",
    "mistake": "wrong_key_index",
}
