"""The tutorial notebook runs top to bottom, and is stored without outputs.

``examples/attention_from_scratch.ipynb`` is executed cell by cell with nbclient in a kernel
running this very interpreter (so it sees the attnscope under test), with its working
folder, its temporary files and IPython's own files all under pytest's ``tmp_path``.
"""

from __future__ import annotations

import json
import sys

import pytest
from conftest import ROOT

NOTEBOOK = ROOT / "examples" / "attention_from_scratch.ipynb"
CELL_TIMEOUT = 120  # seconds per cell; the whole notebook takes a few seconds


def test_notebook_is_stored_without_outputs():
    """Outputs (base64 pictures, HTML reports) would make the repository heavy."""
    nb = json.loads(NOTEBOOK.read_text(encoding="utf-8"))
    code = [cell for cell in nb["cells"] if cell["cell_type"] == "code"]
    assert code, "the notebook has no code cells"
    for cell in code:
        assert cell["outputs"] == [], f"stored with outputs: {''.join(cell['source'])[:60]!r}"
        assert cell["execution_count"] is None


def _this_interpreter_as_python3(tmp_path, monkeypatch) -> None:
    """A ``python3`` kernel spec that runs ``sys.executable``, found before any other."""
    spec = tmp_path / "jupyter" / "kernels" / "python3"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    kernel = {"argv": argv, "display_name": "Python 3", "language": "python"}
    (spec / "kernel.json").write_text(json.dumps(kernel), encoding="utf-8")
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))


def _outputs(nb) -> list[dict]:
    return [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]


def test_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat", reason="the notebook test needs nbformat")
    nbclient = pytest.importorskip("nbclient", reason="the notebook test needs nbclient")
    pytest.importorskip("ipykernel", reason="the notebook test needs ipykernel (a kernel)")
    pytest.importorskip("matplotlib", reason="the notebook draws heatmaps with matplotlib")

    _this_interpreter_as_python3(tmp_path, monkeypatch)
    for name in ("cwd", "tmp", "ipython", "runtime"):
        (tmp_path / name).mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # tempfile.mkdtemp() in the notebook
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))  # no history in ~/.ipython
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("MPLBACKEND", "Agg")  # never a GUI; the notebook asks for inline
    monkeypatch.setenv("NO_COLOR", "1")

    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT,
        kernel_name="python3",
        allow_errors=False,
        resources={"metadata": {"path": str(tmp_path / "cwd")}},
    )
    client.execute()  # raises CellExecutionError, with the cell and traceback, on any error

    outputs = _outputs(nb)
    assert not [out for out in outputs if out.output_type == "error"]
    data = [out.data for out in outputs if out.output_type in ("execute_result", "display_data")]
    html = [d["text/html"] for d in data if "text/html" in d]
    pngs = [d["image/png"] for d in data if "image/png" in d]
    stdout = "".join(out.text for out in outputs if out.output_type == "stream")

    # the trace and the check report display inline as HTML; the heatmaps as pictures
    assert len(html) >= 2, "expected the trace and the check report as inline HTML"
    assert any("keys" in page and "wrong_projection" in page for page in html)
    assert len(pngs) >= 3, "expected inline heatmaps (image/png)"
    # the check section names the slip, and the reader's own classes pass
    assert "first failing stage: keys" in stdout
    assert "MultiHeadAttention ok=True" in stdout
    assert "alone == row 1 of the batch: True" in stdout

    # files go to the temporary folder only: the working folder stays empty
    assert list((tmp_path / "cwd").iterdir()) == []
    written = {p.name for p in (tmp_path / "tmp").rglob("*") if p.is_file()}
    assert {"weights.png", "check-report.html"} <= written
