"""lucidrains performer-pytorch style FastAttention (FAVOR+) in a SelfAttention wrapper: to_q/to_k/
to_v, einops-free head split, softmax_kernel with a fixed Gaussian orthogonal projection matrix (a
buffer drawn once at construction), positive random features exp(w.x - |x|^2/2 - max) * ratio, and
non-causal linear attention D^-1 (Q'(K'^T V)); to_out. Outside the vocabulary: softmax attention is
approximated by random features, so weights are never formed and do not equal softmax(q k^T / sqrt d)."""

import math

import torch
from torch import nn


def orthogonal_matrix_chunk(cols, generator):
    unstructured_block = torch.randn((cols, cols), generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(unstructured_block, mode="reduced")
    return q.t()


def gaussian_orthogonal_random_matrix(nb_rows, nb_columns, generator):
    nb_full_blocks = nb_rows // nb_columns
    block_list = [orthogonal_matrix_chunk(nb_columns, generator) for _ in range(nb_full_blocks)]
    remaining_rows = nb_rows - nb_full_blocks * nb_columns
    if remaining_rows > 0:
        block_list.append(orthogonal_matrix_chunk(nb_columns, generator)[:remaining_rows])
    final_matrix = torch.cat(block_list)
    multiplier = torch.randn((nb_rows, nb_columns), generator=generator, dtype=torch.float64).norm(
        dim=1
    )
    return torch.diag(multiplier) @ final_matrix


def softmax_kernel(data, projection_matrix, is_query, eps=1e-4):
    d = data.shape[-1]
    data_normalizer = d**-0.25
    ratio = projection_matrix.shape[0] ** -0.5
    data_dash = torch.einsum(
        "...id,jd->...ij", data_normalizer * data, projection_matrix.type_as(data)
    )
    diag_data = (data**2).sum(dim=-1) / 2.0 * (data_normalizer**2)
    diag_data = diag_data.unsqueeze(-1)
    if is_query:
        data_dash = ratio * (
            torch.exp(data_dash - diag_data - data_dash.amax(dim=-1, keepdim=True)) + eps
        )
    else:
        data_dash = ratio * (
            torch.exp(data_dash - diag_data - data_dash.amax(dim=(-1, -2), keepdim=True)) + eps
        )
    return data_dash.type_as(data)


def linear_attention(q, k, v):
    k_cumsum = k.sum(dim=-2)
    D_inv = 1.0 / torch.einsum("...nd,...d->...n", q, k_cumsum.type_as(q))
    context = torch.einsum("...nd,...ne->...de", k, v)
    return torch.einsum("...de,...nd,...n->...ne", context, q, D_inv)


class FastAttention(nn.Module):
    def __init__(self, dim_heads, nb_features=32, seed=1295):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.register_buffer(
            "projection_matrix", gaussian_orthogonal_random_matrix(nb_features, dim_heads, g)
        )

    def forward(self, q, k, v):
        q = softmax_kernel(q, self.projection_matrix, is_query=True)
        k = softmax_kernel(k, self.projection_matrix, is_query=False)
        return linear_attention(q, k, v)


class SelfAttention(nn.Module):
    def __init__(self, dim=64, heads=4):
        super().__init__()
        self.heads = heads
        dim_head = dim // heads
        self.fast_attention = FastAttention(dim_head)
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, _ = x.shape
        h = self.heads
        q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)
        q, k, v = (t.view(b, n, h, -1).transpose(1, 2) for t in (q, k, v))
        out = self.fast_attention(q, k, v)
        out = out.transpose(1, 2).reshape(b, n, -1)
        return self.to_out(out)


class PerformerLayer(nn.Module):
    def __init__(self, dim=64):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim)

    def forward(self, x):
        return x + self.attn(self.norm(x))


def make_performer_layer():
    torch.manual_seed(1295)
    layer = PerformerLayer()
    with torch.no_grad():
        layer.norm.weight.uniform_(0.5, 1.5)
        layer.norm.bias.uniform_(-0.2, 0.2)
    return layer.eval()


EXPECT = {
    "target": "make_performer_layer",
    "kind": "multihead",
    "ok": True,
    "layer": "attn",
    "unsupported": "random_feature_kernel",
    "style": "performer-pytorch FastAttention (FAVOR+): fixed orthogonal random features, "
    "softmax_kernel and non-causal linear attention",
}
