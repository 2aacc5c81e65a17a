"""The one-pass image model end to end: file -> patches -> vLLM (out-of-tree pooling model, IO
Processor plugin) -> mask image, with per-patch residuals captured and stored, bad inputs
refused before any model work, and a failing output processor reported without harm."""

from __future__ import annotations

import base64
import io
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import worker_stats
from plain_engines import SEGMENTER_IMAGE
from plain_engines import image as _image

from probehook.models.segmenter import ENGINE_KWARGS, segmenter_path
from probehook.models.segmenter.codec import label_pixels, load_reference, load_spec
from probehook.models.segmenter.processor import SegmentationInputError, read_mask
from probehook.outputs import OUTPUT_PROCESSORS, OutputProcessorError
from probehook.probes import LinearProbe
from probehook.store import ActivationStore

pytestmark = pytest.mark.engine
SPEC = load_spec()
LAYERS = [0, 2]
PROBE = LinearProbe(
    torch.ones(1, SPEC.hidden_size) / 8, torch.zeros(1), layer=1, kind="regression", name="bright"
)


def _png(array: np.ndarray, path: Path) -> Path:
    from PIL import Image

    Image.fromarray(array).save(path)
    return path


def _expected(array: np.ndarray) -> np.ndarray:
    """What the segmenter should say: the rule it was trained on, on the quantised pixels."""
    levels = SPEC.levels - 1
    return label_pixels(np.rint(array / 255.0 * levels) / levels)


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("seg") / "store"


@pytest.fixture(scope="module")
def segmenter(store_path: Path) -> Iterator[Any]:
    from probehook import LLM

    llm = LLM(
        str(segmenter_path()),
        layers=LAYERS,
        probes={"bright": PROBE},
        store=store_path,
        enforce_eager=True,
        gpu_memory_utilization=0.1,
        **ENGINE_KWARGS,
    )
    yield llm
    llm.shutdown()


def _segment(llm: Any, data: Any) -> Any:
    (out,) = llm.encode({"data": data}, pooling_task="plugin", use_tqdm=False)
    return out.outputs


def test_png_in_mask_out(segmenter: Any, tmp_path: Path) -> None:
    image = _image(21, 30)  # not a multiple of the 8-pixel patch: padded, then cropped
    result = _segment(
        segmenter,
        {"image": str(_png(image, tmp_path / "in.png")), "output_path": str(tmp_path / "m.png")},
    )
    assert result["shape"] == [21, 30] and result.mask.shape == (21, 30)
    assert len(result.patches) == 3 * 4
    np.testing.assert_array_equal(result.mask, _expected(image))
    assert result["counts"] == np.bincount(result.mask.ravel(), minlength=4).tolist()
    # The written file and the base64 copy hold the same mask.
    assert result["path"] == str(tmp_path / "m.png")
    np.testing.assert_array_equal(read_mask((tmp_path / "m.png").read_bytes()), result.mask)
    np.testing.assert_array_equal(read_mask(base64.b64decode(result["image"]["data"])), result.mask)


def test_patch_rows_and_scores_equal_reference(segmenter: Any, tmp_path: Path) -> None:
    np.save(tmp_path / "in.npy", _image(16, 16, seed=1).astype(np.float32) / 255)
    result = _segment(segmenter, {"image": str(tmp_path / "in.npy"), "format": "tiff"})
    assert result["image"]["format"] == "tiff" and result["path"] is None
    reference = load_reference()
    for patch in result.patches:
        with torch.no_grad():
            stream = reference.stream(torch.tensor(patch.prompt_token_ids))
        assert len(patch.prompt_token_ids) == SPEC.patch_size**2
        for layer in LAYERS:
            assert torch.allclose(patch.hidden_states[layer], stream[layer], atol=1e-5)
        want = PROBE.score(stream[1])
        assert torch.allclose(patch.probe_scores["bright"], want, atol=1e-5)
        with torch.no_grad():
            logits = reference(torch.tensor(patch.prompt_token_ids))
        assert torch.equal(patch.outputs.data.argmax(-1), logits.argmax(-1))


def test_store_keys_rows_to_input_and_patch(segmenter: Any, store_path: Path) -> None:
    first = _segment(segmenter, {"image": _image(8, 16, seed=2)})
    second = _segment(segmenter, {"image": _image(8, 8, seed=3)})
    reader = ActivationStore.open(store_path)
    keys = []
    for result in (first, second):
        for index, patch in enumerate(result.patches):
            stored = reader[patch.store_id]
            assert stored.record["patch"] == index
            keys.append(stored.record["user_request"])
            assert torch.equal(stored.prefill_hidden_states[2], patch.hidden_states[2])
            assert torch.equal(stored.prefill_probe_scores["bright"], patch.probe_scores["bright"])
    assert keys[0] == keys[1] != keys[2]  # two patches of one input, then the next input


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: _write(d / "notes.txt", b"not an image"), "neither an image"),
        (lambda d: _png(_image(5, 30), d / "small.png"), "smaller than one 8x8 patch"),
        (lambda d: _png(_image(9, 9, channels=4), d / "rgba.png"), "has 4 channel"),
        (lambda d: _png(_image(9, 9)[..., 0], d / "gray.png"), "has 1 channel"),
        (lambda d: _npy_object(d / "obj.npy"), "needs pickle"),
        (lambda d: d / "missing.png", "No such file"),
    ],
)
def test_bad_input_refused_before_model_work(
    segmenter: Any, tmp_path: Path, make: Any, message: str
) -> None:
    steps = worker_stats(segmenter)["steps"]
    with pytest.raises(SegmentationInputError, match=message):
        _segment(segmenter, {"image": str(make(tmp_path))})
    assert worker_stats(segmenter)["steps"] == steps  # the engine never ran a step for it


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _npy_object(path: Path) -> Path:
    np.save(path, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    return path


def test_failing_output_processor_is_named_and_engine_serves_on(
    segmenter: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    processor = OUTPUT_PROCESSORS["segmentation_image"]

    def broken(parsed: Any, outputs: list[Any]) -> Any:
        raise RuntimeError("palette exploded")

    with monkeypatch.context() as patch:
        patch.setattr(processor, "assemble", broken)
        with pytest.raises(OutputProcessorError) as caught:
            _segment(segmenter, {"image": _image(8, 8)})
    message = str(caught.value)
    assert "'segmentation_image' failed" in message and "palette exploded" in message
    assert "engine requests ['" in message  # the patch requests, by id
    result = _segment(segmenter, {"image": _image(8, 8, seed=4)})  # still serving
    np.testing.assert_array_equal(result.mask, _expected(_image(8, 8, seed=4)))


def test_without_capture_it_is_plain_vllm(plain_engines: dict) -> None:
    """No layers, no probes: vLLM's own engine (and runner); the same mask, and every output
    has probehook's attributes, empty (the engine runs in the plain-engines subprocess,
    tests/plain_engines.py)."""
    report = plain_engines["segmenter"]
    assert report["session"] is False
    np.testing.assert_array_equal(np.array(report["mask"]), _expected(_image(*SEGMENTER_IMAGE)))
    assert report["patches"] == 2  # 8x16 pixels in 8x8 patches
    assert report["patch_captures"] == [["{}", "{}", None]] * 2, report


def test_processor_checks_without_an_engine() -> None:
    processor = OUTPUT_PROCESSORS["segmentation_image"]
    with pytest.raises(SegmentationInputError, match="output_path is not accepted over HTTP"):
        processor.parse({"image": "x", "output_path": "/tmp/x.png"}, online=True)
    with pytest.raises(SegmentationInputError, match="base64"):
        processor.parse({"image": "/etc/hostname"}, online=True)  # never a server path
    with pytest.raises(SegmentationInputError, match="valid formats are"):
        processor.parse({"image": _image(8, 8), "format": "jpeg"}, online=False)
    with pytest.raises(SegmentationInputError, match="Unknown key"):
        processor.parse({"image": _image(8, 8), "colour": 1}, online=False)
    buf = io.BytesIO()
    np.save(buf, _image(8, 8))
    parsed = processor.parse({"image": base64.b64encode(buf.getvalue()).decode()}, online=True)
    assert parsed.pixels.shape == (8, 8, 3)


def test_server_pooling_route_returns_base64_mask(tmp_path: Path) -> None:
    from helpers import post_json

    from probehook.testing import ServerProcess

    argv = [str(segmenter_path()), "--layers", "0,2", "--skip-tokenizer-init"]
    argv += ["--store", str(tmp_path / "store"), "--store-flush-interval", "0.2"]
    argv += ["--no-enable-prefix-caching", "--dtype", "float32", "--enforce-eager"]
    argv += ["--gpu-memory-utilization", "0.1"]
    server = ServerProcess(argv, log=tmp_path / "server.log")
    try:
        server.wait()
        image = _image(12, 20, seed=5)
        png = _png(image, tmp_path / "in.png").read_bytes()
        request = {"data": {"image": base64.b64encode(png).decode()}}
        status, body = post_json(server.port, "/pooling", request)
        assert status == 200, body
        data = body["data"]
        assert data["shape"] == [12, 20] and data["path"] is None and "mask" not in data
        mask = read_mask(base64.b64decode(data["image"]["data"]))
        np.testing.assert_array_equal(mask, _expected(image))
        # Bad input is a 400 naming the problem, and the server never reads its own files.
        for bad, message in [
            ({"image": "/etc/hostname"}, "base64"),
            ({"image": base64.b64encode(b"hello").decode()}, "neither an image"),
            ({"image": base64.b64encode(png).decode(), "output_path": "/tmp/x"}, "output_path"),
        ]:
            status, body = post_json(server.port, "/pooling", {"data": bad})
            assert status == 400 and message in body["error"]["message"], body
        assert post_json(server.port, "/pooling", request)[0] == 200  # still serving
        # Opting in stores every patch's rows, keyed to the request and the patch.
        status, body = post_json(server.port, "/pooling", {**request, "probehook": {"layers": [2]}})
        assert status == 200 and body["data"]["shape"] == [12, 20], body
        store_ids = body["probehook"]["store_ids"]
        assert len(store_ids) == 2 * 3  # 12x20 pixels in 8x8 patches
        reference = load_reference()
        deadline = time.monotonic() + 30
        while True:  # committed within a flush interval
            reader = ActivationStore.open(tmp_path / "store")
            if all(i in reader for i in store_ids) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        for index, store_id in enumerate(store_ids):
            stored = reader[store_id]
            assert stored.record["user_request"] == body["request_id"]
            assert stored.record["patch"] == index
            assert sorted(stored.prefill_hidden_states) == [2]
            with torch.no_grad():
                want = reference.stream(torch.tensor(stored.prompt_token_ids))[2]
            assert torch.allclose(stored.prefill_hidden_states[2], want, atol=1e-5)
        assert len(reader) == len(store_ids)  # requests that did not opt in stored nothing
    finally:
        server.stop()
