"""Embeddings files (.pt, .npy, .csv) and token labels, and the errors for bad ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnscope
from attnscope.errors import AttnScopeError
from attnscope.inputs import (
    load_embeddings,
    parse_labels,
    read_labels_file,
    resolve_labels,
)

BOOK = attnscope.book_embeddings()


def test_pt_tensor_loads_as_float32(tmp_path):
    path = tmp_path / "x.pt"
    torch.save(BOOK.double(), path)
    emb = load_embeddings(path)
    assert emb.tensor.dtype == torch.float32 and torch.allclose(emb.tensor, BOOK)
    assert emb.labels is None and emb.tokens == 6


def test_pt_dict_with_embeddings_and_labels(tmp_path):
    path = tmp_path / "x.pt"
    torch.save({"embeddings": BOOK, "labels": list(attnscope.BOOK_TOKENS)}, path)
    emb = load_embeddings(path)
    assert emb.labels == attnscope.BOOK_TOKENS


def test_pt_batched_tensor_keeps_its_batch(tmp_path):
    path = tmp_path / "x.pt"
    torch.save(torch.stack((BOOK, BOOK)), path)
    assert load_embeddings(path).tensor.shape == (2, 6, 3)
    with pytest.raises(AttnScopeError, match="expected shape"):
        load_embeddings(path, ranks=(2,))


def test_npy_array_of_floats_or_integers_loads(tmp_path):
    path = tmp_path / "x.npy"
    np.save(path, BOOK.numpy().astype(np.float64))
    assert torch.allclose(load_embeddings(path).tensor, BOOK)
    np.save(path, np.arange(6).reshape(3, 2))
    assert load_embeddings(path).tensor.tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]


def test_csv_of_numbers_loads_without_labels(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text("0.43, 0.15, 0.89\n0.55,0.87,0.66\n\n# a comment\n")
    emb = load_embeddings(path)
    assert emb.tensor.shape == (2, 3) and emb.labels is None
    assert torch.allclose(emb.tensor[0], BOOK[0])


def test_csv_non_numeric_first_column_is_the_token_labels(tmp_path):
    path = tmp_path / "x.csv"
    rows = [
        f"{w},{','.join(str(v) for v in r)}"
        for w, r in zip(attnscope.BOOK_TOKENS, BOOK.tolist(), strict=True)
    ]
    path.write_text("\n".join(rows))
    emb = load_embeddings(path)
    assert emb.labels == attnscope.BOOK_TOKENS
    assert torch.allclose(emb.tensor, BOOK)


def test_pandas_csv_with_its_index_column_reads_the_index_as_labels(tmp_path):
    """``DataFrame.to_csv()``: a header whose first cell is empty, then the index."""
    path = tmp_path / "x.csv"
    path.write_text(",0,1,2\n0,0.43,0.15,0.89\n1,0.55,0.87,0.66\n")
    emb = load_embeddings(path)
    assert emb.labels == ("0", "1") and emb.tensor.shape == (2, 3)
    assert torch.allclose(emb.tensor[0], BOOK[0])
    path.write_text(",a,b\ncat,1,2\nsat,3,4\n")  # a named index
    emb = load_embeddings(path)
    assert emb.labels == ("cat", "sat") and emb.tensor.tolist() == [[1.0, 2.0], [3.0, 4.0]]


def test_pt_labels_that_are_not_strings_are_made_text(tmp_path):
    path = tmp_path / "x.pt"
    torch.save({"embeddings": BOOK, "labels": [10, 11, 12, 13, 14, 15]}, path)
    assert load_embeddings(path).labels == ("10", "11", "12", "13", "14", "15")


def test_csv_header_line_is_skipped(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text("token,x,y\ncat,1,2\nsat,3,4\n")
    emb = load_embeddings(path)
    assert emb.labels == ("cat", "sat") and emb.tensor.tolist() == [[1.0, 2.0], [3.0, 4.0]]
    path.write_text("x,y\n1,2\n3,4\n")
    emb = load_embeddings(path)
    assert emb.labels is None and emb.tensor.shape == (2, 2)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("1,2\n3\n", "line 2: expected 2 comma-separated fields"),
        ("1,2\n3,abc\n", "line 2, column 2: expected a number, got 'abc'"),
        ("1,nan\n", "expected a finite number"),
        ("1,inf\n", "expected a finite number"),
        ("", "expected at least one token"),
        ("# only a comment\n\n", "expected at least one token"),
        ("a\nb\n", "expected numbers after the label"),
        ("1e39,1\n", "finite numbers"),  # overflows float32
    ],
)
def test_malformed_csv_is_one_clear_error_naming_the_line(tmp_path, content, message):
    path = tmp_path / "bad.csv"
    path.write_text(content)
    with pytest.raises(AttnScopeError, match="bad.csv") as info:
        load_embeddings(path)
    assert message in str(info.value)


def test_binary_file_named_csv_is_rejected(tmp_path):
    path = tmp_path / "x.csv"
    path.write_bytes(b"\xff\xfe\x00\x81")
    with pytest.raises(AttnScopeError, match="UTF-8"):
        load_embeddings(path)


def test_missing_file_folder_and_unknown_suffix_are_rejected(tmp_path):
    with pytest.raises(AttnScopeError, match="no such file"):
        load_embeddings(tmp_path / "nope.npy")
    with pytest.raises(AttnScopeError, match="folder"):
        load_embeddings(tmp_path)
    txt = tmp_path / "x.txt"
    txt.write_text("1,2")
    with pytest.raises(AttnScopeError, match=r"\.pt, \.npy, \.csv.*'\.txt'"):
        load_embeddings(txt)


@pytest.mark.parametrize(
    ("array", "message"),
    [
        (np.zeros(3), "expected shape"),
        (np.zeros((1, 2, 3, 4)), "rank 4"),
        (np.zeros((0, 3)), "at least one token"),
        (np.zeros((3, 0)), "at least one feature"),
        (np.array([[1.0, np.nan]]), "NaN or inf"),
        (np.array([[1.0, np.inf]]), "NaN or inf"),
        (np.array([["a", "b"]]), "array of numbers"),
        (np.array([[True, False]]), "array of numbers"),
        (np.array([[1 + 2j]]), "array of numbers"),
    ],
)
def test_bad_npy_arrays_are_rejected(tmp_path, array, message):
    path = tmp_path / "x.npy"
    np.save(path, array)
    with pytest.raises(AttnScopeError, match=message):
        load_embeddings(path)


def test_npy_of_python_objects_is_refused_without_unpickling(tmp_path):
    path = tmp_path / "x.npy"
    np.save(path, np.array([[1, "a"]], dtype=object), allow_pickle=True)
    with pytest.raises(AttnScopeError, match="Python objects"):
        load_embeddings(path)


def test_corrupt_npy_and_pt_files_are_rejected(tmp_path):
    for name in ("x.npy", "x.pt"):
        path = tmp_path / name
        path.write_bytes(b"not a real file")
        with pytest.raises(AttnScopeError, match="could not read"):
            load_embeddings(path)


def test_pt_with_code_is_not_run(tmp_path):
    """weights_only=True: a pickled arbitrary object is refused, not executed."""

    path = tmp_path / "x.pt"
    torch.save({"embeddings": BOOK, "extra": np.float64(1.0)}, path)  # a numpy global
    with pytest.raises(AttnScopeError, match="could not read"):
        load_embeddings(path)


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ({"weights": BOOK}, "'embeddings' key"),
        ([1, 2, 3], "expected a tensor"),
        (torch.ones(3, 2, dtype=torch.bool), "real numbers"),
        ({"embeddings": BOOK, "labels": ["a", "b"]}, "expected 6 labels"),
        ({"embeddings": BOOK, "labels": "abcdef"}, "list of labels"),
        ({"embeddings": BOOK, "labels": ["a", "b", "c", "d", "e", ""]}, "non-empty label"),
    ],
)
def test_bad_pt_contents_are_rejected(tmp_path, obj, message):
    path = tmp_path / "x.pt"
    torch.save(obj, path)
    with pytest.raises(AttnScopeError, match=message):
        load_embeddings(path)


def test_labels_from_text_and_file(tmp_path):
    assert parse_labels(" cat, sat ,mat") == ("cat", "sat", "mat")
    path = tmp_path / "labels.txt"
    path.write_text("cat\nsat\nmat\n\n")
    assert read_labels_file(path) == ("cat", "sat", "mat")


def test_bad_labels_are_rejected(tmp_path):
    with pytest.raises(AttnScopeError, match="non-empty label at position 1"):
        parse_labels("cat,,mat")
    with pytest.raises(AttnScopeError, match="no such file"):
        read_labels_file(tmp_path / "missing.txt")
    with pytest.raises(AttnScopeError, match="expected a labels file, got a folder"):
        read_labels_file(tmp_path)
    blank = tmp_path / "blank.txt"
    blank.write_text("a\n\nb\n")
    with pytest.raises(AttnScopeError, match="position 1"):
        read_labels_file(blank)


def test_resolve_labels_prefers_given_then_file_then_default():
    assert resolve_labels(("a", "b"), ("c", "d"), 2) == ("a", "b")
    assert resolve_labels(None, ("c", "d"), 2) == ("c", "d")
    assert resolve_labels(None, None, 2, default=("x", "y")) == ("x", "y")
    assert resolve_labels(None, None, 3) == ("0", "1", "2")
    with pytest.raises(AttnScopeError, match="--labels: expected 3 labels"):
        resolve_labels(("a", "b"), None, 3)
