"""Attention scores for one query computed through a numpy round trip."""

import numpy as np
import torch


def numpy_scores(inputs, query_index):
    arr = inputs.detach().cpu().numpy()
    scores = arr @ arr[query_index]
    return torch.from_numpy(np.ascontiguousarray(scores)).to(inputs.dtype)


EXPECT = {"target": "numpy_scores", "kind": "scores", "ok": True}
