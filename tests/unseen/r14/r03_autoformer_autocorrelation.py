"""Autoformer (thuml) AutoCorrelation in place of attention, in an EncoderLayer with series decomposition.

This file: refused (period-based time-delay aggregation, not a softmax over query . key)."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class AutoCorrelation(nn.Module):
    """Period-based dependencies from the FFT auto-correlation, aggregated by time-delay rolling."""

    def __init__(
        self, mask_flag=False, factor=1, scale=None, attention_dropout=0.0, output_attention=False
    ):
        super().__init__()
        self.factor = factor
        self.scale = scale
        self.mask_flag = mask_flag
        self.output_attention = output_attention
        self.dropout = nn.Dropout(attention_dropout)

    def time_delay_agg_inference(self, values, corr):
        batch, head, channel, length = values.shape
        init_index = (
            torch.arange(length, device=values.device)
            .view(1, 1, 1, -1)
            .repeat(batch, head, channel, 1)
        )
        top_k = max(1, int(self.factor * math.log(length)))
        mean_value = torch.mean(torch.mean(corr, dim=1), dim=1)  # (batch, length)
        weights, delay = torch.topk(mean_value, top_k, dim=-1)
        tmp_corr = torch.softmax(weights, dim=-1)
        tmp_values = values.repeat(1, 1, 1, 2)
        delays_agg = torch.zeros_like(values)
        for i in range(top_k):
            tmp_delay = init_index + delay[:, i].view(-1, 1, 1, 1)
            pattern = torch.gather(tmp_values, dim=-1, index=tmp_delay)
            delays_agg = delays_agg + pattern * tmp_corr[:, i].view(-1, 1, 1, 1)
        return delays_agg

    def forward(self, queries, keys, values, attn_mask):
        B, L, H, E = queries.shape
        _, S, _, D = values.shape
        if L > S:
            zeros = torch.zeros_like(queries[:, : (L - S), :]).to(queries.dtype)
            values = torch.cat([values, zeros], dim=1)
            keys = torch.cat([keys, zeros], dim=1)
        else:
            values = values[:, :L, :, :]
            keys = keys[:, :L, :, :]
        q_fft = torch.fft.rfft(queries.permute(0, 2, 3, 1).contiguous(), dim=-1)
        k_fft = torch.fft.rfft(keys.permute(0, 2, 3, 1).contiguous(), dim=-1)
        res = q_fft * torch.conj(k_fft)
        corr = torch.fft.irfft(res, n=L, dim=-1)
        V = self.time_delay_agg_inference(values.permute(0, 2, 3, 1).contiguous(), corr).permute(
            0, 3, 1, 2
        )
        return V.contiguous(), None


class AutoCorrelationLayer(nn.Module):
    def __init__(self, correlation, d_model, n_heads, d_keys=None, d_values=None):
        super().__init__()
        d_keys = d_keys or (d_model // n_heads)
        d_values = d_values or (d_model // n_heads)
        self.inner_correlation = correlation
        self.query_projection = nn.Linear(d_model, d_keys * n_heads)
        self.key_projection = nn.Linear(d_model, d_keys * n_heads)
        self.value_projection = nn.Linear(d_model, d_values * n_heads)
        self.out_projection = nn.Linear(d_values * n_heads, d_model)
        self.n_heads = n_heads

    def forward(self, queries, keys, values, attn_mask):
        B, L, _ = queries.shape
        _, S, _ = keys.shape
        H = self.n_heads
        queries = self.query_projection(queries).view(B, L, H, -1)
        keys = self.key_projection(keys).view(B, S, H, -1)
        values = self.value_projection(values).view(B, S, H, -1)
        out, attn = self.inner_correlation(queries, keys, values, attn_mask)
        out = out.view(B, L, -1)
        return self.out_projection(out), attn


class moving_avg(nn.Module):
    def __init__(self, kernel_size, stride):
        super().__init__()
        self.kernel_size = kernel_size
        self.avg = nn.AvgPool1d(kernel_size=kernel_size, stride=stride, padding=0)

    def forward(self, x):
        front = x[:, 0:1, :].repeat(1, (self.kernel_size - 1) // 2, 1)
        end = x[:, -1:, :].repeat(1, (self.kernel_size - 1) // 2, 1)
        x = torch.cat([front, x, end], dim=1)
        return self.avg(x.permute(0, 2, 1)).permute(0, 2, 1)


class series_decomp(nn.Module):
    def __init__(self, kernel_size):
        super().__init__()
        self.moving_avg = moving_avg(kernel_size, stride=1)

    def forward(self, x):
        moving_mean = self.moving_avg(x)
        return x - moving_mean, moving_mean


class EncoderLayer(nn.Module):
    def __init__(self, attention, d_model, d_ff=None, moving_avg=25, dropout=0.0):
        super().__init__()
        d_ff = d_ff or 4 * d_model
        self.attention = attention
        self.conv1 = nn.Conv1d(d_model, d_ff, kernel_size=1, bias=False)
        self.conv2 = nn.Conv1d(d_ff, d_model, kernel_size=1, bias=False)
        self.decomp1 = series_decomp(moving_avg)
        self.decomp2 = series_decomp(moving_avg)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, attn_mask=None):
        new_x, attn = self.attention(x, x, x, attn_mask=attn_mask)
        x = x + self.dropout(new_x)
        x, _ = self.decomp1(x)
        y = self.dropout(F.gelu(self.conv1(x.transpose(-1, 1))))
        y = self.dropout(self.conv2(y).transpose(-1, 1))
        res, _ = self.decomp2(x + y)
        return res


class Encoder(nn.Module):
    def __init__(self, attn_layers, norm_layer=None):
        super().__init__()
        self.attn_layers = nn.ModuleList(attn_layers)
        self.norm = norm_layer

    def forward(self, x, attn_mask=None):
        for attn_layer in self.attn_layers:
            x = attn_layer(x, attn_mask=attn_mask)
        return self.norm(x) if self.norm is not None else x


class AutoformerEncoderLite(nn.Module):
    def __init__(self, d_model=64, n_heads=4, factor=3):
        super().__init__()
        self.encoder = Encoder(
            [
                EncoderLayer(
                    AutoCorrelationLayer(AutoCorrelation(False, factor), d_model, n_heads),
                    d_model,
                    moving_avg=5,
                )
            ],
            norm_layer=nn.LayerNorm(d_model),
        )

    def forward(self, x):
        return self.encoder(x)


def make_autoformer_encoder():
    torch.manual_seed(1463)
    model = AutoformerEncoderLite()
    with torch.no_grad():
        model.encoder.norm.weight.uniform_(0.6, 1.4)
        model.encoder.norm.bias.normal_(0.0, 0.1)
    return model.eval()


EXPECT = {
    "target": "make_autoformer_encoder",
    "kind": "multihead",
    "ok": True,
    "layer": "encoder.attn_layers.0.attention",
    "unsupported": "autocorrelation",
    "style": "Autoformer AutoCorrelationLayer: FFT auto-correlation of queries and keys, top-k delays by"
    " mean correlation, softmax over the k delays and time-delay roll aggregation of values; "
    "series_decomp encoder layer",
}
