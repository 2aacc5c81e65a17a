"""The store outside probehook: the h5py-only reader in docs/store.md, and to_hf_dataset."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from probehook.errors import MissingExtraError, ProbehookError
from probehook.store import ActivationStore
from probehook.store.format import MANIFEST_FILE, encode_line
from probehook.store.writer import PendingRequest, RowBlock

DOC = Path(__file__).resolve().parents[1] / "docs" / "store.md"
HIDDEN = 8
LAYERS = (1, 3)


def fake_request(i: int, prompt_len: int = 4, n_out: int = 3, n_completions: int = 1, dtype=None):
    """Like tests/test_store_unit.py's, with several completions to exercise their order."""
    g = torch.Generator().manual_seed(i)
    dtype = dtype or torch.float32
    completions = [
        {
            "index": c,
            "token_ids": [10 + c + t for t in range(n_out)],
            "text": "x" * n_out,
            "finish_reason": "length",
        }
        for c in range(n_completions)
    ]
    record = {
        "id": f"r{i}",
        "prompt": f"p{i}",
        "prompt_token_ids": list(range(prompt_len)),
        "sampling_params": {"max_tokens": n_out, "n": n_completions},
        "completions": completions,
    }
    blocks = []
    for layer in LAYERS:
        rows = torch.randn(prompt_len, HIDDEN, generator=g).to(dtype)
        blocks.append(RowBlock("prefill", None, layer, 0, rows))
        for c in range(n_completions):
            rows = torch.randn(n_out, HIDDEN, generator=g).to(dtype)
            blocks.append(RowBlock("decode", c, layer, prompt_len - 1, rows))
    return PendingRequest(record, blocks)


def write_store(path: Path, dtype: torch.dtype, n: int = 6) -> ActivationStore:
    meta = {
        "model": "m",
        "model_fingerprint": "abc",
        "dtype": str(dtype).removeprefix("torch."),
        "hidden_size": HIDDEN,
        "layers": list(LAYERS),
    }
    store = ActivationStore.for_writing(path, meta, shard_bytes=700)  # several shards
    for i in range(n):
        store.add(fake_request(i, 3 + i, 1 + i % 3, 2 - i % 2, dtype))
    store.flush()
    store.close()
    return ActivationStore.open(path)


def doc_reader() -> str:
    """The python block after the h5py-reader marker in docs/store.md."""
    match = re.search(r"<!-- h5py-reader.*?-->\n```python\n(.*?)```", DOC.read_text(), re.S)
    assert match, f"no h5py-reader block in {DOC}"
    return match.group(1)


def float32(rows: torch.Tensor) -> np.ndarray:
    return rows.float().numpy()


def test_doc_reader_imports_only_the_promised_modules() -> None:
    imported = set()
    for node in ast.walk(ast.parse(doc_reader())):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported <= {"json", "zlib", "numpy", "h5py"}, imported


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_doc_reader_reads_what_probehook_wrote(tmp_path: Path, dtype: torch.dtype) -> None:
    root = tmp_path / "runs" / "exp1"  # the path the doc's block names, relative to cwd
    store = write_store(root, dtype)
    assert store.info()["shards"] > 1
    # A corrupt line (bad CRC) then a valid one: readers skip the bad line and keep the next.
    ghost = {**next(store.requests).record, "id": "ghost"}
    line = json.loads(encode_line(ghost))
    line["crc"] += 1
    with open(root / MANIFEST_FILE, "a") as f:
        f.write(json.dumps(line) + "\n" + encode_line({**ghost, "id": "ghost2"}))
    store = ActivationStore.open(root)
    assert "ghost" not in store and "ghost2" in store and len(store) == 7

    out = tmp_path / "out"
    out.mkdir()
    epilogue = (
        f"\nnp.save({str(out / 'rows.npy')!r}, rows)"
        f"\nnp.save({str(out / 'matrix.npy')!r}, matrix)"
        f"\njson.dump(record, open({str(out / 'record.json')!r}, 'w'))\n"
    )
    # Neither probehook nor torch can be imported: the block stands on its own.
    blocker = "import sys\nfor name in ('probehook', 'torch', 'vllm', 'transformers'):\n"
    blocker += "    sys.modules[name] = None\n"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-c", blocker + doc_reader() + epilogue],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr

    record = json.loads((out / "record.json").read_text())
    stored = store[record["id"]]
    assert record == stored.record
    completions = range(len(record["completions"]))
    assert len(completions) == 2  # rows of every completion, in completion order
    expected = torch.cat([stored.completion_hidden_states(c)[3] for c in completions])
    assert np.array_equal(np.load(out / "rows.npy"), float32(expected))
    matrix = np.load(out / "matrix.npy")
    assert matrix.dtype == np.float32
    assert np.array_equal(matrix, float32(store.layer(3, phase="decode")[:]))


# -- to_hf_dataset ----------------------------------------------------------------------------


def test_hf_dataset_matches_layer_and_labels(tmp_path: Path) -> None:
    store = write_store(tmp_path / "s", torch.float32)
    for phase, token in (("decode", "all"), ("prefill", "last")):
        matrix = store.layer(3, phase=phase, token=token)
        labels = [f"y{i}" for i in range(len(matrix))]
        ds = store.to_hf_dataset(
            3, phase, token, labels=labels, cache_dir=tmp_path / "hf", block_rows=4
        )
        assert len(ds) == len(matrix)
        assert ds.features["activations"].length == HIDDEN
        cols = ds.with_format("numpy")
        assert np.array_equal(np.stack(cols["activations"][:]), float32(matrix[:]))
        assert list(cols["store_id"][:]) == list(matrix.index["store_id"])
        assert np.array_equal(cols["position"][:], matrix.index["position"])
        assert np.array_equal(cols["token_id"][:], matrix.index["token_id"])
        assert ds["label"] == labels
    no_labels = store.to_hf_dataset(1, cache_dir=tmp_path / "hf")
    assert "label" not in no_labels.column_names
    with pytest.raises(ValueError, match="labels has 2 entries"):
        store.to_hf_dataset(3, labels=[0, 1], cache_dir=tmp_path / "hf")


def test_hf_dataset_bfloat16_becomes_float32(tmp_path: Path) -> None:
    store = write_store(tmp_path / "s", torch.bfloat16)
    labels = np.arange(len(store.layer(1)))  # numpy labels become plain ints
    ds = store.to_hf_dataset(1, labels=labels, cache_dir=tmp_path / "hf")
    assert ds.features["activations"].feature.dtype == "float32"
    rows = np.stack(ds.with_format("numpy")["activations"][:])
    assert rows.dtype == np.float32
    assert np.array_equal(rows, float32(store.layer(1)[:]))
    assert ds["label"] == labels.tolist()


def test_hf_dataset_cache_follows_store_contents(tmp_path: Path) -> None:
    store = write_store(tmp_path / "s", torch.float32, n=2)
    first = store.to_hf_dataset(3, cache_dir=tmp_path / "hf")
    again = store.to_hf_dataset(3, cache_dir=tmp_path / "hf")
    assert again.cache_files == first.cache_files  # same contents: the Arrow file is reused
    appender = ActivationStore.for_writing(tmp_path / "s", store.meta)
    appender.add(fake_request(7))
    appender.flush()
    appender.close()
    grown = ActivationStore.open(tmp_path / "s").to_hf_dataset(3, cache_dir=tmp_path / "hf")
    assert len(grown) == len(first) + 3 and grown.cache_files != first.cache_files


def test_hf_dataset_without_datasets_names_the_extra(tmp_path: Path, monkeypatch) -> None:
    store = write_store(tmp_path / "s", torch.float32, n=1)
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(MissingExtraError, match=r"pip install 'probehook\[hf\]'") as err:
        store.to_hf_dataset(3, cache_dir=tmp_path / "hf")
    assert isinstance(err.value, ImportError) and isinstance(err.value, ProbehookError)
