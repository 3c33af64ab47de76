"""What the checker does with outputs and targets that go wrong in ways a verdict cannot
cover: NaN and inf named where they appear, outputs of the wrong shape refused, unbatched
input read with another meaning set aside, the JSON contract kept whatever happens, a
default timeout, and the attention found inside a wrapper."""

from __future__ import annotations

import json
import textwrap

import jsonschema
import pytest
from conftest import ROOT

from attnscope import AttnScopeError, check
from attnscope.cli import build_parser, main
from attnscope.stages import Stage

LAYER = """
    import math
    import torch
    from torch import nn

    class Attn(nn.Module):
        def __init__(self, d_in=10, d_out=12):
            super().__init__()
            self.a = nn.Linear(d_in, d_out)
            self.b = nn.Linear(d_in, d_out)
            self.c = nn.Linear(d_in, d_out)

        def forward(self, x):
            q, k, v = self.a(x), self.b(x), self.c(x)
            {BODY}
"""

CORRECT = """w = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(k.shape[-1]), dim=-1)
            return w @ v"""


def _target(tmp_path, body: str) -> str:
    path = tmp_path / "layer.py"
    path.write_text(textwrap.dedent(LAYER.replace("{BODY}", body)))
    return f"{path}:Attn"


def test_nan_in_the_output_is_named_where_it_first_appears(tmp_path):
    body = """w = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(k.shape[-1]), dim=-1)
            w = w * torch.log(w - 1)
            return w @ v"""
    report = check(_target(tmp_path, body))
    f = report.first_failure
    assert (f.stage, f.mistake) == (Stage.WEIGHTS, "other")
    assert "NaN" in f.message and "log" in f.message and "layer.py:" in f.message


def test_inf_in_the_values_is_blamed_on_the_values(tmp_path):
    body = """v = v / 0.0
            w = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(k.shape[-1]), dim=-1)
            return w @ v"""
    f = check(_target(tmp_path, body)).first_failure
    assert (f.stage, f.mistake) == (Stage.VALUES, "other")
    assert "inf" in f.message


def test_an_output_of_another_width_is_refused_with_both_shapes(tmp_path):
    body = CORRECT.replace("return w @ v", "return (w @ v)[..., :1]")
    with pytest.raises(AttnScopeError, match=r"expected an output of shape \(2, \d+, 12\).*got"):
        check(_target(tmp_path, body))


def test_a_known_mistake_that_changes_the_width_is_still_named(tmp_path):
    """Heads averaged instead of concatenated: the width changes, and the catalogue says why."""
    body = """b, t, _ = x.shape
            split = lambda z: z.view(b, t, 3, 4).transpose(1, 2)
            q, k, v = split(q), split(k), split(v)
            w = torch.softmax(q @ k.transpose(-2, -1) / 2.0, dim=-1)
            return (w @ v).mean(dim=1)"""
    f = check(_target(tmp_path, body)).first_failure
    assert (f.stage, f.mistake) == (Stage.OUTPUT, "heads_merge")


def test_unbatched_input_read_as_a_batch_is_set_aside(tmp_path):
    """A module that reads the batch from size(0) takes (tokens, d) as a batch of tokens and
    returns (tokens, 1, d): checked on batched input, with a note that says why."""
    body = """bsz = x.size(0)
            q, k, v = (t.view(bsz, -1, 12) for t in (q, k, v))
            w = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(12), dim=-1)
            return w @ v"""
    report = check(_target(tmp_path, body))
    assert report.ok, report.to_text(color=False)
    assert any("not one row per token" in n for n in report.notes)


def test_json_on_exit_2_is_the_contracts_error_report(tmp_path, capsys, report_schema):
    body = CORRECT.replace("return w @ v", "return (w @ v)[..., :1]")
    code = main(["check", _target(tmp_path, body), "--json"])
    captured = capsys.readouterr()
    assert code == 2
    data = json.loads(captured.out)
    jsonschema.validate(data, report_schema)
    assert data["ok"] is False and "expected an output of shape" in data["error"]["message"]
    assert "expected an output of shape" in captured.err


def test_json_stdout_holds_one_object_when_the_target_prints(tmp_path, capsys, report_schema):
    body = 'print("hello from the target")\n            ' + CORRECT
    code = main(["check", _target(tmp_path, body), "--json"])
    captured = capsys.readouterr()
    assert code == 0
    data = json.loads(captured.out)  # nothing else on stdout
    jsonschema.validate(data, report_schema)
    assert "hello from the target" in captured.err


def test_json_report_says_the_structure_read(tmp_path, capsys, report_schema):
    main(["check", _target(tmp_path, CORRECT), "--json"])
    data = json.loads(capsys.readouterr().out)
    jsonschema.validate(data, report_schema)
    assert data["structure"] == {
        "heads": 1,
        "kv_heads": 1,
        "head_dim": 12,
        "causal": False,
        "cross": False,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    }


def test_default_timeout_is_stated_and_zero_turns_it_off():
    parser = build_parser()
    check_parser = parser._subparsers._group_actions[0].choices["check"]
    assert "default 60" in check_parser.format_help()
    assert check_parser.parse_args(["t.py:X"]).timeout == 60
    assert check_parser.parse_args(["t.py:X", "--timeout", "0"]).timeout is None


def test_a_target_that_hangs_is_stopped_by_the_default_timeout(tmp_path, monkeypatch):
    import attnscope.checking.engine as engine

    monkeypatch.setattr(engine, "DEFAULT_TIMEOUT", 1.0)
    body = "while True:\n                pass"
    with pytest.raises(AttnScopeError, match="ran past --timeout 1s"):
        check(_target(tmp_path, body), timeout=1.0)


BLOCK = """
    import torch
    from torch import nn

    class Mixer(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.f = nn.Linear(dim, 3 * dim)
            self.g = nn.Linear(dim, dim)

        def forward(self, x, mask=None):
            b, t, d = x.shape
            q, k, v = self.f(x).view(b, t, 3, 4, d // 4).permute(2, 0, 3, 1, 4)
            s = (q @ k.transpose(-2, -1)) * (d // 4) ** -0.5
            s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
            return self.g((s.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)){SLIP}

    class Block(nn.Module):
        def __init__(self, dim=16):
            super().__init__()
            self.norm = nn.LayerNorm(dim)
            self.inner = nn.ModuleDict({"mix": Mixer(dim)})
            self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

        def forward(self, x):
            x = x + self.inner["mix"](self.norm(x))
            return x + self.mlp(x)
"""


@pytest.mark.parametrize("slip,expected", [("", ("ok",)), (" * 2", ("output", "other"))])
def test_attention_inside_a_block_is_found_and_named(tmp_path, slip, expected):
    """Heads only in a view, weights under names that say nothing, a ModuleDict: the layer,
    its heads and its projections come from what it computes."""
    path = tmp_path / "block.py"
    path.write_text(textwrap.dedent(BLOCK.replace("{SLIP}", slip)))
    report = check(f"{path}:Block")
    got = ("ok",) if report.ok else (report.first_failure.stage.value, report.first_failure.mistake)
    assert got == expected, report.to_text(color=False)
    assert report.layer == "inner.mix"
    assert report.kind == "causal-multihead"
    assert report.structure["heads"] == 4 and report.structure["head_dim"] == 12 // 4  # dim=12
    assert report.to_dict()["layer"] == "inner.mix"


ROPE = """
    import torch
    from torch import nn

    class Rotary(nn.Module):
        def __init__(self, dim=16, heads=2):
            super().__init__()
            self.h = heads
            self.qkv = nn.Linear(dim, 3 * dim)
            hd = dim // heads
            inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
            ang = torch.outer(torch.arange(64).float(), inv)
            self.register_buffer("cos", torch.cat([ang, ang], -1).cos())
            self.register_buffer("sin", torch.cat([ang, ang], -1).sin())

        def rot(self, t):
            a, b = t.chunk(2, dim=-1)
            n = t.shape[-2]
            return t * self.cos[:n] + torch.cat([-b, a], -1) * self.sin[:n]

        def forward(self, x):
            b, n, d = x.shape
            q, k, v = self.qkv(x).view(b, n, 3, self.h, -1).permute(2, 0, 3, 1, 4)
            q, k = self.rot(q), self.rot(k)
            w = (q @ k.transpose(-2, -1) / (d // self.h) ** 0.5).softmax(-1)
            return (w @ v).transpose(1, 2).reshape(b, n, d)
"""


GAIN = ROPE.replace(
    "return t * self.cos[:n] + torch.cat([-b, a], -1) * self.sin[:n]",
    "return t * (1 + self.sin[:n].abs())  # a position-dependent gain: no rotation",
)


def test_a_rotary_layer_is_read_from_its_tables(tmp_path):
    """The rotation is read back from what the layer computed: pairing, fraction, base."""
    path = tmp_path / "rope.py"
    path.write_text(textwrap.dedent(ROPE))
    report = check(f"{path}:Rotary", kind="multihead")
    assert report.ok, report.to_text(color=False)
    assert report.structure["rope"] == {"pairing": "half", "fraction": 1.0, "base": 10000.0}


def test_a_feature_not_modelled_yet_is_refused_with_its_line(tmp_path, capsys):
    """A position-dependent factor on the queries that is no rotation: refused, not judged."""
    path = tmp_path / "gain.py"
    path.write_text(textwrap.dedent(GAIN))
    assert "no rotation" in GAIN
    refused = r"not supported yet: .*factor on the queries at .*gain.py:\d+"
    with pytest.raises(AttnScopeError, match=refused):
        check(f"{path}:Rotary")
    assert main(["check", f"{path}:Rotary"]) == 2


SAME_NUMBERS_TWICE = """
    import torch
    from torch import nn

    class Sloppy(nn.Module):
        def __init__(self, d_in=3, d_out=2):
            super().__init__()
            self.W_query = nn.Linear(d_in, d_out, bias=False)
            self.W_key = nn.Linear(d_in, d_out, bias=False)
            self.W_value = nn.Linear(d_in, d_out, bias=False)

        def forward(self, x):
            queries = self.W_query(x)
            keys = self.W_query(x)  # the slip
            values = self.W_value(x)
            w = torch.softmax(queries @ keys.transpose(-2, -1) / keys.shape[-1] ** 0.5, dim=-1)
            return w @ values
"""


def test_the_line_named_is_the_one_that_made_the_wrong_stage(tmp_path):
    """Keys made with W_query are the queries' numbers: the line named is the keys' own."""
    path = tmp_path / "sloppy.py"
    path.write_text(textwrap.dedent(SAME_NUMBERS_TWICE))
    report = check(f"{path}:Sloppy")
    assert report.first_failure.mistake == "wrong_projection"
    line = next(i for i, t in enumerate(path.read_text().splitlines(), 1) if "the slip" in t)
    assert report.first_failure.location == f"{path}:{line}"


def test_the_scores_kind_predicts_one_score_per_token():
    path = ROOT / "examples" / "gallery" / "correct" / "scores_matmul.py"
    text = path.read_text()
    name = text.split('"target": "')[1].split('"')[0]
    report = check(f"{path}:{name}", kind="scores")
    scores = next(c for c in report.checks if c.stage is Stage.SCORES)
    assert scores.predicted == scores.actual and len(scores.predicted) == 1
