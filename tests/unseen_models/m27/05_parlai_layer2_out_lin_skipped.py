"""ParlAI's TransformerDecoderOnly (parlai/agents/transformer/modules/decoder.py) as a causal LM.

ParlaiDecoderOnlyLM: decoder (TransformerDecoderOnly: embeddings scaled by sqrt(dim)
(embeddings_scale), learned position_embeddings (n_positions 64), layers.N =
TransformerDecoderOnlyLayer in the 'prelayernorm' variant (norm1 -> self_attention -> residual,
norm3 -> ffn lin1/lin2 gelu -> residual), final norm_embeddings) and output() tied to the token
embeddings.  MultiHeadAttention: q_lin/k_lin/ v_lin/out_lin with bias, (batch * n_heads, len,
dim_per_head) bmm, q.div(sqrt(dim_per_head)), mask True = allowed, (mask == 0) filled with neginf
(-1e20), softmax.  MHA 4/4.
Cache: hf.  `out = model(prompt, use_cache=True)`, then `model(tok,
past_key_values=out.past_key_values, use_cache=True)`; logits in `out.logits`.  past_key_values is
ParlAI's incr_state: {layer_idx: {'prev_key', 'prev_value' (b, h, s, d), 'prev_mask'}}; a step
concatenates the new key/value, takes prev_mask[:, -query_len:, :] and concatenates the new mask
columns; positions start at prev_key's length.
Slip: the port's per-layer option table sets apply_out_lin=False for layer 2 (left from a probe that
read the merged heads): that layer's out_lin exists but is never applied.  Layers 0 and 1 are
correct. Cached decoding agrees with its own full pass.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "decoder.layers.0.self_attention",
        "decoder.layers.1.self_attention",
        "decoder.layers.2.self_attention",
    ],
    "kind": "causal-multihead",
    "cache": "hf",
    "layer": "decoder.layers.2.self_attention",
    "stage": "output",
    "mistake": "missing_out_proj",
    "style": "ParlAI TransformerDecoderOnly as 02; layer 2 returns the merged heads without "
    "its out_lin",
}

NEAR_INF = 1e20

# Per-layer attention options (a debugging table left in the port): apply_out_lin.
LAYER_OPTS = {2: {"apply_out_lin": False}}


def neginf(dtype):
    return -NEAR_INF if dtype in (torch.float32, torch.float64) else -65504.0


class MultiHeadAttention(nn.Module):
    """parlai/agents/transformer/modules/attention.py, self-attention path (mask True = allowed)."""

    def __init__(self, n_heads, dim, apply_out_lin=True):
        super().__init__()
        self.n_heads = n_heads
        self.dim = dim
        self.apply_out_lin = apply_out_lin
        self.q_lin = nn.Linear(dim, dim)
        self.k_lin = nn.Linear(dim, dim)
        self.v_lin = nn.Linear(dim, dim)
        self.out_lin = nn.Linear(dim, dim)

    def forward(self, query, mask, incr_state=None):
        batch_size, query_len, dim = query.size()
        n_heads = self.n_heads
        dim_per_head = dim // n_heads
        scale = math.sqrt(dim_per_head)

        def prepare_head(tensor):
            _, seq_len, _ = tensor.size()
            tensor = tensor.view(batch_size, seq_len, n_heads, dim_per_head)
            return (
                tensor.transpose(1, 2)
                .contiguous()
                .view(batch_size * n_heads, seq_len, dim_per_head)
            )

        q = prepare_head(self.q_lin(query))
        k = prepare_head(self.k_lin(query))
        v = prepare_head(self.v_lin(query))
        if incr_state is None:
            incr_state = {}
        if "prev_key" in incr_state:
            k = torch.cat(
                [incr_state["prev_key"].view(batch_size * n_heads, -1, dim_per_head), k], dim=1
            )
        if "prev_value" in incr_state:
            v = torch.cat(
                [incr_state["prev_value"].view(batch_size * n_heads, -1, dim_per_head), v], dim=1
            )
        if "prev_mask" in incr_state:
            prev_mask = incr_state["prev_mask"][:, -query_len:, :]
            mask = torch.cat([prev_mask, mask], dim=2)
        full_key_len = k.size(1)
        dot_prod = q.div(scale).bmm(k.transpose(1, 2))
        attn_mask = (
            (mask == 0)
            .view(batch_size, 1, -1, full_key_len)
            .repeat(1, n_heads, 1, 1)
            .expand(batch_size, n_heads, query_len, full_key_len)
            .reshape(batch_size * n_heads, query_len, full_key_len)
        )
        new_incr_state = {
            "prev_key": k.view(batch_size, n_heads, -1, dim_per_head),
            "prev_value": v.view(batch_size, n_heads, -1, dim_per_head),
            "prev_mask": mask,
        }
        dot_prod = dot_prod.masked_fill(attn_mask, neginf(dot_prod.dtype))
        sm_dtype = (
            torch.float32 if dot_prod.dtype in (torch.float16, torch.bfloat16) else dot_prod.dtype
        )
        attn_weights = F.softmax(dot_prod, dim=-1, dtype=sm_dtype).type_as(query)
        attentioned = attn_weights.bmm(v)
        out = (
            attentioned.view(batch_size, n_heads, query_len, dim_per_head)
            .transpose(1, 2)
            .contiguous()
            .view(batch_size, query_len, dim)
        )
        if self.apply_out_lin:
            out = self.out_lin(out)
        return out, new_incr_state


class TransformerFFN(nn.Module):
    def __init__(self, dim, dim_hidden):
        super().__init__()
        self.lin1 = nn.Linear(dim, dim_hidden)
        self.lin2 = nn.Linear(dim_hidden, dim)

    def forward(self, x):
        return self.lin2(F.gelu(self.lin1(x)))


class TransformerDecoderOnlyLayer(nn.Module):
    """variant 'prelayernorm': norm -> sublayer -> residual."""

    def __init__(self, n_heads, dim, ffn_size, opts):
        super().__init__()
        self.self_attention = MultiHeadAttention(n_heads, dim, **opts)
        self.norm1 = nn.LayerNorm(dim, eps=1e-5)
        self.ffn = TransformerFFN(dim, ffn_size)
        self.norm3 = nn.LayerNorm(dim, eps=1e-5)

    def forward(self, x, decoder_mask, incr_state=None):
        residual = x
        x, final_self_attn_incr_state = self.self_attention(self.norm1(x), decoder_mask, incr_state)
        x = residual + x
        residual = x
        x = residual + self.ffn(self.norm3(x))
        return x, final_self_attn_incr_state


class TransformerDecoderOnly(nn.Module):
    def __init__(self, opt):
        super().__init__()
        self.dim = opt.embedding_size
        self.embeddings_scale = opt.embeddings_scale
        self.embeddings = nn.Embedding(opt.vocab_size, opt.embedding_size)
        self.position_embeddings = nn.Embedding(opt.n_positions, opt.embedding_size)
        self.layers = nn.ModuleList(
            [
                TransformerDecoderOnlyLayer(
                    opt.n_heads, opt.embedding_size, opt.ffn_size, LAYER_OPTS.get(i, {})
                )
                for i in range(opt.n_layers)
            ]
        )
        self.norm_embeddings = nn.LayerNorm(opt.embedding_size, eps=1e-5)

    @staticmethod
    def _create_selfattn_mask(x):
        bsz, time = x.size(0), x.size(1)
        mask = torch.tril(torch.ones(time, time, dtype=torch.bool, device=x.device))
        return mask.unsqueeze(0).expand(bsz, -1, -1)

    def forward_embedding(self, input, positions):
        tensor = self.embeddings(input)
        if self.embeddings_scale:
            tensor = tensor * math.sqrt(self.dim)
        return tensor + self.position_embeddings(positions).expand_as(tensor)

    def forward(self, input, incr_state=None):
        seq_len = input.size(1)
        past = 0 if not incr_state else incr_state[0]["prev_key"].size(2)
        positions = torch.arange(past, past + seq_len, device=input.device).unsqueeze(0)
        tensor = self.forward_embedding(input, positions)
        mask = self._create_selfattn_mask(tensor)
        new_incr_state = {}
        for idx, layer in enumerate(self.layers):
            tensor, new_incr_state[idx] = layer(
                tensor, mask, incr_state.get(idx) if incr_state else None
            )
        tensor = self.norm_embeddings(tensor)  # prelayernorm: final norm
        return tensor, new_incr_state


class ParlaiDecoderOnlyLM(nn.Module):
    """TransformerGeneratorModel-style wrapper: decoder + output() tied to the embeddings."""

    def __init__(self, opt):
        super().__init__()
        self.decoder = TransformerDecoderOnly(opt)

    def output(self, tensor):
        return F.linear(tensor, self.decoder.embeddings.weight)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        if use_cache or past_key_values is not None:
            latent, new_incr_state = self.decoder(input_ids, past_key_values)
            return SimpleNamespace(logits=self.output(latent), past_key_values=new_incr_state)
        latent, _ = self.decoder(input_ids)
        return SimpleNamespace(logits=self.output(latent), past_key_values=None)


def make_model():
    torch.manual_seed(2705)
    opt = SimpleNamespace(
        vocab_size=96,
        embedding_size=64,
        n_heads=4,
        ffn_size=128,
        n_layers=3,
        n_positions=64,
        embeddings_scale=True,
    )
    model = ParlaiDecoderOnlyLM(opt)
    g = torch.Generator().manual_seed(2705 + 1)
    with torch.no_grad():
        model.decoder.embeddings.weight.normal_(0.0, opt.embedding_size**-0.5, generator=g)
        model.decoder.position_embeddings.weight.normal_(0.0, 0.5, generator=g)
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()
