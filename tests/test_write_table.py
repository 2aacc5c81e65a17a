"""The write table's step writer (probehook/worker/write_table.py): each step, every asking
request's tokens point at its row (row i + 1 for batch position i) and its row holds its terms;
the next step starts clean; a request whose terms the worker cannot read writes nothing and is
named with the reason (the worker fails its capture with it)."""

from __future__ import annotations

import numpy as np
import torch
from toy_intervention import ScaleWriter

from probehook.worker.write_table import StepWrites


def table() -> tuple[StepWrites, ScaleWriter]:
    writer = ScaleWriter(layer=1, slots=4, device=torch.device("cpu"))
    writer.index = torch.zeros(16, dtype=torch.int64)
    return StepWrites({("scale", "L1"): writer}), writer


def test_each_asking_request_s_tokens_point_at_its_row() -> None:
    writes, writer = table()
    terms = {"a": {"scale": {"L1": 0.5}}, "b": None, "c": {"scale": {"L1": 2.0}}}
    writes.prepare(["a", "b", "c"], np.array([0, 3, 5, 9]), terms.get)
    assert writer.index[:10].tolist() == [1, 1, 1, 0, 0, 3, 3, 3, 3, 0]
    assert writer.buffers["factors"][[1, 3]].tolist() == [0.5, 2.0]
    assert writes.steps_written == 1 and not writes.take_failed()
    # the next step: c alone, now at batch position 0; a's tokens no longer point anywhere
    writes.prepare(["c"], np.array([0, 1]), terms.get)
    assert writer.index[:10].tolist() == [1] + [0] * 9
    assert writer.buffers["factors"][1] == 2.0
    writes.prepare(["b"], np.array([0, 1]), terms.get)  # nobody writes: all clear
    assert not writer.index.any() and writes.steps_written == 2


def test_a_request_whose_terms_cannot_be_read_writes_nothing_and_is_named() -> None:
    writes, writer = table()
    terms = {"a": {"scale": {"L9": 0.5}}, "b": {"scale": {"L1": "x"}}, "c": {"scale": {"L1": 3}}}
    writes.prepare(["a", "b", "c"], np.array([0, 2, 4, 6]), terms.get)
    assert writer.index[:6].tolist() == [0, 0, 0, 0, 3, 3]  # c alone
    failed = writes.take_failed()
    assert set(failed) == {"a", "b"} and not writes.take_failed()  # taken once
    assert "scale['L9'], which this engine does not install" in failed["a"]
    assert failed["b"].startswith("ValueError: could not convert string to float")
