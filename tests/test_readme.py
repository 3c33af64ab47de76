"""The README's two set-up commands are the ones CI runs."""

from __future__ import annotations

import re

from conftest import ROOT


def _commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    setup = readme.split("## Set up", 1)[1].split("##", 1)[0]
    block = re.search(r"```bash\n(.*?)```", setup, re.S).group(1)
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def test_readme_has_exactly_two_setup_commands():
    demo, tests = _commands()
    assert demo.endswith("attnscope demo")
    assert tests.endswith("python -m pytest -q -n auto")
    assert "-c constraints/cpu.txt" in demo and "-c constraints/cpu.txt" in tests


def test_ci_runs_the_readme_test_command_verbatim():
    _, tests = _commands()
    assert tests in (ROOT / ".ci" / "run").read_text()
