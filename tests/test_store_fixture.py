"""A store written by the code of 2026-11-29 (``tests/data/store-2026-11-29``, written by
``scripts/make_store_fixture.py`` before the readout table's port) reads unchanged: its hidden
rows, probe scores, SAE features, lens readings and the toy readout's rows, prompt and decode,
bit-equal to what was read right after writing; and ``fsck`` and ``compact`` keep them so.
The store code may change; stores users already have must not (issue 50). No engine.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

FIXTURE = Path(__file__).parent / "data" / "store-2026-11-29"


@pytest.fixture()
def copied(tmp_path: Path) -> Path:
    """A copy of the fixture (maintenance writes; the committed files stay as written)."""
    return Path(shutil.copytree(FIXTURE / "store", tmp_path / "store"))


def _read_everything(path: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    try:
        from make_store_fixture import expected_tensors
    finally:
        sys.path.pop(0)
    from probehook.store import ActivationStore

    return expected_tensors(ActivationStore.open(path))


def _assert_bit_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key


def test_a_store_written_before_the_port_reads_bit_equal(copied: Path) -> None:
    want = load_file(str(FIXTURE / "expected.safetensors"))
    ids = json.loads((FIXTURE / "expected.json").read_text())["store_ids"]
    got, read_ids = _read_everything(copied)
    assert read_ids == ids and len(ids) == 4
    kinds = {key.split("/")[1] for key in want}
    assert kinds == {"hidden", "scores", "sae", "lens", "norm"}  # every kind it holds
    _assert_bit_equal(got, want)
    # A readout's rows as its outputs hold them (out.lens["l"][3]), not only by flat name.
    from probehook.store import ActivationStore

    stored = ActivationStore.open(copied)[ids[0]]
    presented = stored.readout("lens")["l"][3]
    assert torch.equal(presented.token_ids, stored.top_k("lens")["l@3"].token_ids)
    assert set(stored.readout("lens", "prefill")) == {"l"}


def test_fsck_and_compact_keep_an_old_store_bit_equal(copied: Path) -> None:
    from probehook.store.maintenance import compact, fsck

    want = load_file(str(FIXTURE / "expected.safetensors"))
    report = fsck(copied)
    assert report.ok, report
    compact(copied, progress=False)
    assert len(list((copied / "shards").glob("*.h5"))) == 1  # the two runs' shards merged
    assert fsck(copied).ok
    got, _ = _read_everything(copied)
    _assert_bit_equal(got, want)
