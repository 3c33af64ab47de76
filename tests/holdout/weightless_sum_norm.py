"""Weightless attention normalising the raw scores by their row sums instead of using softmax."""


def attend(X):
    S = X @ X.transpose(-1, -2)
    A = S / S.sum(dim=-1, keepdim=True)
    return A @ X


EXPECT = {
    "target": "attend",
    "kind": "simplified",
    "ok": False,
    "stage": "weights",
    "mistake": "not_softmax",
}
