"""Every way a check can fail to run gives one clear message (API) and exit code 2 (CLI)."""

from __future__ import annotations

import textwrap

import pytest
import torch
from torch import nn

from attnscope import AttnScopeError, check
from attnscope.cli import main


def _file(tmp_path, body: str, name: str = "target.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


GOOD_HEAD = """
    import torch
    from torch import nn

    class Head(nn.Module):
        def __init__(self, d_in, d_out):
            super().__init__()
            self.W_query = nn.Linear(d_in, d_out, bias=False)
            self.W_key = nn.Linear(d_in, d_out, bias=False)
            self.W_value = nn.Linear(d_in, d_out, bias=False)

        def forward(self, x):
            q, k, v = self.W_query(x), self.W_key(x), self.W_value(x)
            w = torch.softmax(q @ k.transpose(-2, -1) / k.shape[-1] ** 0.5, dim=-1)
            return {RETURN}
"""


def _head(tmp_path, ret="w @ v"):
    return _file(tmp_path, GOOD_HEAD.replace("{RETURN}", ret))


@pytest.mark.parametrize(
    "target,match",
    [
        ("no_colon_here", "expected path/to/file.py:NAME"),
        ("missing_file.py:Thing", "expected an existing Python file"),
        ("no_such_package_xyz.mod:Thing", "could not import module"),
        ("attnscope.modules:NoSuchThing", "has no 'NoSuchThing'"),
        ("attnscope.modules:", "expected a NAME"),
    ],
)
def test_unloadable_targets(target, match):
    with pytest.raises(AttnScopeError, match=match):
        check(target)


def test_file_that_raises_on_import(tmp_path):
    path = _file(tmp_path, "raise RuntimeError('boom at import')\n")
    with pytest.raises(AttnScopeError, match="importing it raised RuntimeError: boom at import"):
        check(f"{path}:Anything")


def test_missing_name_lists_what_the_file_defines(tmp_path):
    path = _head(tmp_path)
    with pytest.raises(AttnScopeError, match="it defines: Head"):
        check(f"{path}:Nope")


def test_constructor_argument_that_cannot_be_inferred(tmp_path):
    path = _file(
        tmp_path,
        """
        from torch import nn
        class Weird(nn.Module):
            def __init__(self, flux_capacitor):
                super().__init__()
        """,
    )
    with pytest.raises(
        AttnScopeError, match=r"cannot infer constructor argument 'flux_capacitor'.*--init"
    ):
        check(f"{path}:Weird")


def test_constructor_that_raises_with_given_init(tmp_path):
    path = _head(tmp_path)
    with pytest.raises(AttnScopeError, match=r"Head\(d_in=3\) raised TypeError"):
        check(f"{path}:Head", init={"d_in": 3})


def test_init_for_an_instance_is_refused():
    with pytest.raises(AttnScopeError, match="--init: expected a class"):
        check(nn.Linear(3, 3), init={"x": 1})


def test_init_must_be_a_dict():
    with pytest.raises(AttnScopeError, match="--init: expected a JSON object"):
        check("attnscope.modules:SelfAttentionV2", init=[1, 2])


def test_unknown_kind():
    with pytest.raises(AttnScopeError, match="--kind: expected one of"):
        check("attnscope.modules:SelfAttentionV2", kind="bidirectional")


def test_kind_cross_on_a_layer_without_a_second_input():
    with pytest.raises(AttnScopeError, match="--kind cross: expected a layer that takes a second"):
        check("attnscope.modules:SelfAttentionV2", kind="cross")


def test_module_returning_a_non_tensor(tmp_path):
    path = _head(tmp_path, ret="'not a tensor'")
    with pytest.raises(AttnScopeError, match="expected the module to return a tensor"):
        check(f"{path}:Head")


def test_module_returning_the_wrong_shape(tmp_path):
    path = _head(tmp_path, ret="(w @ v).sum(-2)")
    with pytest.raises(AttnScopeError, match="expected an output with one row per token"):
        check(f"{path}:Head")


def test_module_raising_on_every_probe(tmp_path):
    path = _head(tmp_path, ret="1 / 0")
    with pytest.raises(AttnScopeError, match=r"raised on every probe.*ZeroDivisionError"):
        check(f"{path}:Head")


def test_timeout(tmp_path):
    path = _head(tmp_path, ret="__import__('time').sleep(5)")
    with pytest.raises(AttnScopeError, match="ran past --timeout 0.2s"):
        check(f"{path}:Head", timeout=0.2)


def test_no_attention_in_the_computation_is_named():
    """A module that computes no token x token product is not judged: exit 2, saying what
    was looked for."""

    class Anonymous(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.randn(4, 6))

        def forward(self, x):
            return x @ self.a

    with pytest.raises(AttnScopeError, match=r"Anonymous.*found no attention in its computation"):
        check(Anonymous())


def test_weights_naming_an_unknown_path_or_role():
    from attnscope import SelfAttentionV2

    with pytest.raises(AttnScopeError, match="expected a parameter or submodule path"):
        check(SelfAttentionV2(4, 6), weights={"query": "nope", "key": "W_key", "value": "W_value"})
    with pytest.raises(AttnScopeError, match="expected roles query, key, value"):
        check(SelfAttentionV2(4, 6), weights={"banana": "W_key"})


def test_plain_function_for_a_module_kind():
    with pytest.raises(AttnScopeError, match="a plain function can be checked as 'scores'"):
        check(lambda x: x, kind="causal")


def test_module_for_the_scores_kind():
    from attnscope import SelfAttentionV2

    with pytest.raises(AttnScopeError, match="--kind scores: expected a function"):
        check(SelfAttentionV2(4, 6), kind="scores")


def test_factory_that_returns_no_module():
    def factory():
        return 42

    with pytest.raises(AttnScopeError, match="must return an nn.Module"):
        check(factory)


def test_scores_function_of_the_wrong_shape():
    with pytest.raises(AttnScopeError, match=r"expected one score per token, shape \(7,\)"):
        check(lambda inputs, i: inputs @ inputs.T, kind="scores")


def test_simplified_function_of_the_wrong_shape():
    with pytest.raises(AttnScopeError, match="expected context vectors of the input's shape"):
        check(lambda inputs: inputs.sum(), kind="simplified")


def test_bad_probe_length():
    with pytest.raises(AttnScopeError, match="--tokens: expected an integer of at least 2"):
        check("attnscope.modules:SelfAttentionV2", tokens=1)


# ----------------------------------------------------------------------------------- CLI


def _run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    "argv,match",
    [
        (["check", "missing.py:X"], "expected an existing Python file"),
        (["check", "attnscope.modules:SelfAttentionV2", "--init", "{not json"], "--init"),
        (["check", "attnscope.modules:SelfAttentionV2", "--init", "[1]"], "--init"),
        (["check", "attnscope.modules:SelfAttentionV2", "--kind", "both"], "invalid choice"),
        (["check", "attnscope.modules:SelfAttentionV2", "--weights", "query"], "--weights"),
    ],
)
def test_cli_user_errors_exit_2_with_one_message(capsys, argv, match):
    code, out, err = _run(capsys, *argv)
    assert code == 2
    assert match in err
    assert "Traceback" not in err


def test_cli_refuses_to_overwrite_an_html_report(capsys, tmp_path):
    existing = tmp_path / "report.html"
    existing.write_text("keep me")
    code, _, err = _run(
        capsys, "check", "attnscope.modules:SelfAttentionV2", "--html", str(existing)
    )
    assert code == 2 and "--force" in err
    assert existing.read_text() == "keep me"


def test_sys_exit_in_the_target_is_its_failure(tmp_path):
    """sys.exit() in the user's code is reported as the target raising, not our exit code."""
    path = _head(tmp_path, ret="__import__('sys').exit(4)")
    with pytest.raises(AttnScopeError, match=r"raised on every probe: .*SystemExit: 4"):
        check(f"{path}:Head")
    exits_on_import = _file(tmp_path, "import sys\nsys.exit(3)\n", name="exits.py")
    with pytest.raises(AttnScopeError, match="importing it raised SystemExit"):
        check(f"{exits_on_import}:Anything")


def test_timeout_covers_importing_the_file(tmp_path):
    path = _file(tmp_path, "while True:\n    pass\n", name="spins.py")
    with pytest.raises(AttnScopeError, match="importing it ran past --timeout 0.3s"):
        check(f"{path}:Anything", timeout=0.3)


def test_the_targets_own_timeout_error_is_not_taken_for_ours(tmp_path):
    path = _head(tmp_path, ret="(_ for _ in ()).throw(TimeoutError('the net'))")
    with pytest.raises(AttnScopeError, match=r"raised on every probe: .*TimeoutError: the net"):
        check(f"{path}:Head")


def test_syntax_error_names_the_users_line(tmp_path):
    path = _file(tmp_path, "x = 1\ndef broken(:\n    pass\n", name="broken.py")
    with pytest.raises(AttnScopeError, match=r"SyntaxError: .*broken\.py:2\)"):
        check(f"{path}:broken")


def test_long_probe_with_an_inferred_context_length():
    """--tokens larger than the default context length: the inferred one grows to hold it."""
    report = check("attnscope.modules:CausalAttention", tokens=40)
    assert report.ok, report.to_text(color=False)
