"""The ``segmentation_image`` output processor: an image or array file in, a class mask out.

Input side: read the file (PNG/TIFF/JPEG through Pillow, ``.npy`` arrays with pickle refused),
check it, pad it to whole patches and turn each patch into a prompt. Output side: put the
patches' per-pixel classes back on the grid, crop the padding, and render the mask as a
palette PNG (or TIFF). Offline the result also carries the mask as a numpy array and the path
it was written to; online the image comes back base64-encoded in the JSON response.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from einops import rearrange

from probehook.models.segmenter.codec import CLASSES, SegmenterSpec, load_spec, pixels_to_ids
from probehook.outputs.registry import OnePassProcessor

FORMATS = {"png": "PNG", "tiff": "TIFF"}
PALETTE = [(0, 0, 0), (220, 40, 40), (40, 180, 60), (40, 80, 220)]  # per class, RGB
ARRAY_SUFFIXES = (".npy",)


class SegmentationInputError(ValueError):
    """The input is not something the segmenter can read; raised before any model work."""


class SegmentationResult(dict):
    """The JSON-ready result (``shape``, ``classes``, ``counts``, ``image``: ``{"format",
    "data"}`` base64, ``path``) plus, offline, ``mask`` (``[H, W]`` uint8 class per pixel)
    and ``patches`` (the pooled output of each patch, with its captures)."""

    mask: np.ndarray
    patches: list[Any]


@dataclass(frozen=True)
class ParsedImage:
    pixels: np.ndarray  # [H, W, C] float32 in [0, 1]
    output_path: Path | None
    fmt: str
    online: bool


class SegmentationImage(OnePassProcessor):
    name = "segmentation_image"
    pooling_task = "token_classify"

    def __init__(self, spec: SegmenterSpec | None = None) -> None:
        self._spec = spec

    @property
    def spec(self) -> SegmenterSpec:
        if self._spec is None:
            self._spec = load_spec()
        return self._spec

    def parse(self, data: Any, online: bool) -> ParsedImage:
        if isinstance(data, str | Path | np.ndarray):
            data = {"image": data}
        if not isinstance(data, dict) or "image" not in data:
            raise SegmentationInputError(
                f"Expected {{'image': <path, base64 string or array>, 'output_path': ..., "
                f"'format': 'png'|'tiff'}}, got {type(data).__name__}."
            )
        unknown = set(data) - {"image", "output_path", "format"}
        if unknown:
            raise SegmentationInputError(
                f"Unknown key(s) {sorted(unknown)}; valid keys are image, output_path, format."
            )
        fmt = str(data.get("format") or "png").lower()
        if fmt not in FORMATS:
            raise SegmentationInputError(f"format={fmt!r}; valid formats are {list(FORMATS)}.")
        output_path = data.get("output_path")
        if online and output_path is not None:
            raise SegmentationInputError(
                "output_path is not accepted over HTTP: the server writes no files for a "
                "client; the mask comes back base64-encoded in the response."
            )
        pixels = self._read(data["image"], online)
        return ParsedImage(pixels, Path(output_path) if output_path else None, fmt, online)

    def _read(self, image: Any, online: bool) -> np.ndarray:
        if isinstance(image, np.ndarray):
            if online:
                raise SegmentationInputError("An array cannot come over HTTP; send base64.")
            return self._check(image, "the array")
        if not isinstance(image, str | Path):
            raise SegmentationInputError(
                f"image must be a path, a base64 string or an array, not {type(image).__name__}."
            )
        if online:  # never a path on the server's disk
            try:
                raw = base64.b64decode(str(image), validate=True)
            except ValueError as exc:
                raise SegmentationInputError(
                    "Over HTTP, image must be a base64-encoded PNG/TIFF/JPEG or .npy file."
                ) from exc
            return self._check(_decode(raw, "the base64 image"), "the base64 image")
        path = Path(image)
        if not path.is_file():
            raise SegmentationInputError(f"No such file: {str(path)!r}.")
        return self._check(_decode(path.read_bytes(), str(path)), str(path))

    def _check(self, array: np.ndarray, what: str) -> np.ndarray:
        spec = self.spec
        if array.ndim == 2:
            array = array[..., None]
        if array.ndim != 3:
            raise SegmentationInputError(
                f"{what} has shape {array.shape}; expected [height, width, {spec.channels}]."
            )
        if array.shape[-1] != spec.channels:
            raise SegmentationInputError(
                f"{what} has {array.shape[-1]} channel(s); the segmenter reads "
                f"{spec.channels} (RGB). Convert it (e.g. PIL's .convert('RGB'))."
            )
        height, width = array.shape[:2]
        if height < spec.patch_size or width < spec.patch_size:
            raise SegmentationInputError(
                f"{what} is {height}x{width} pixels, smaller than one {spec.patch_size}x"
                f"{spec.patch_size} patch."
            )
        if array.dtype == np.uint8:
            return array.astype(np.float32) / 255.0
        if not np.issubdtype(array.dtype, np.floating):
            raise SegmentationInputError(
                f"{what} has dtype {array.dtype}; use uint8 (0..255) or floats in [0, 1]."
            )
        if not np.isfinite(array).all() or array.min() < 0 or array.max() > 1:
            raise SegmentationInputError(f"{what} has float values outside [0, 1].")
        return array.astype(np.float32)

    def grid(self, parsed: ParsedImage) -> tuple[int, int]:
        """Patches down and across (the image is padded to whole patches)."""
        p = self.spec.patch_size
        height, width = parsed.pixels.shape[:2]
        return -(-height // p), -(-width // p)

    def split(self, parsed: ParsedImage) -> list[dict[str, Any]]:
        p = self.spec.patch_size
        rows, cols = self.grid(parsed)
        height, width = parsed.pixels.shape[:2]
        padded = np.pad(
            parsed.pixels, ((0, rows * p - height), (0, cols * p - width), (0, 0)), mode="edge"
        )
        return [
            {
                "prompt_token_ids": pixels_to_ids(
                    padded[r * p : (r + 1) * p, c * p : (c + 1) * p], self.spec
                )
            }
            for r in range(rows)
            for c in range(cols)
        ]

    def assemble(self, parsed: ParsedImage, outputs: list[Any]) -> SegmentationResult:
        p = self.spec.patch_size
        rows, cols = self.grid(parsed)
        if len(outputs) != rows * cols:
            raise ValueError(f"expected {rows * cols} patch outputs, got {len(outputs)}")
        # Each patch's class per pixel, [patches, p * p] in row-major patch order, tiled back
        # into the image's grid.
        labels = np.stack([np.asarray(o.outputs.data.float()).argmax(-1) for o in outputs])
        mask = rearrange(
            labels.astype(np.uint8), "(r c) (ph pw) -> (r ph) (c pw)", r=rows, c=cols, ph=p, pw=p
        )
        height, width = parsed.pixels.shape[:2]
        mask = mask[:height, :width]
        encoded = render(mask, parsed.fmt)
        path = None
        if parsed.output_path is not None:
            parsed.output_path.parent.mkdir(parents=True, exist_ok=True)
            parsed.output_path.write_bytes(encoded)
            path = str(parsed.output_path)
        result = SegmentationResult(
            shape=[height, width],
            classes=list(CLASSES),
            counts=np.bincount(mask.ravel(), minlength=len(CLASSES)).tolist(),
            image={"format": parsed.fmt, "data": base64.b64encode(encoded).decode()},
            path=path,
        )
        if not parsed.online:
            result.mask = mask
            result.patches = list(outputs)
        return result

    def to_response(self, value: Any) -> Any:
        return dict(value)


def render(mask: np.ndarray, fmt: str = "png") -> bytes:
    """A class mask as a palette image file (PNG or TIFF)."""
    from PIL import Image

    image = Image.fromarray(mask, mode="P")
    image.putpalette([v for color in PALETTE for v in color])
    buf = io.BytesIO()
    image.save(buf, format=FORMATS[fmt])
    return buf.getvalue()


def read_mask(data: bytes) -> np.ndarray:
    """The class mask of an image written by :func:`render` (its palette indices)."""
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)))


def _decode(raw: bytes, what: str) -> np.ndarray:
    if raw[:6] == b"\x93NUMPY":
        try:
            return np.load(io.BytesIO(raw), allow_pickle=False)
        except ValueError as exc:  # object arrays need pickle: refused
            raise SegmentationInputError(f"{what} is a .npy file that needs pickle: {exc}") from exc
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(raw)) as image:
            image.load()
            if image.mode == "P":  # palette indices are not pixel values
                image = image.convert("RGB")
            return np.asarray(image)
    except (UnidentifiedImageError, OSError) as exc:
        raise SegmentationInputError(
            f"{what} is neither an image Pillow can read (PNG, TIFF, JPEG, ...) nor a .npy array."
        ) from exc
