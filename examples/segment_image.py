"""Segment an image with a one-pass, non-text model through vLLM, and keep its activations.

python examples/segment_image.py [IMAGE] [--out MASK.png] [--store DIR] [-v]

The bundled tiny segmenter labels each pixel background, red, green or blue (whichever channel
dominates). The image is split into 8x8 patches, each patch runs as one vLLM pooling request
under the same input, and the ``segmentation_image`` output processor reassembles the mask.
Without IMAGE, a synthetic picture is drawn; the residual stream of every patch (layers 0 and
2) goes to an activation store, keyed to the input and the patch.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from probehook.logs import quiet_vllm

# vLLM's warnings and loading bars stay out of the result unless run with -v.
QUIET = quiet_vllm()


def synthetic_image(path: Path) -> Path:
    """Three coloured rectangles on a dark, noisy background."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    image = rng.random((40, 56, 3)) * 0.2
    for (top, left), channel in zip([(4, 4), (16, 22), (26, 40)], range(3), strict=True):
        image[top : top + 12, left : left + 14] = 0.15
        image[top : top + 12, left : left + 14, channel] = 0.9
    Image.fromarray((image * 255).astype(np.uint8)).save(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("image", nargs="?", help="PNG/TIFF/JPEG or .npy (default: synthetic)")
    parser.add_argument("--out", help="where to write the mask (PNG, or TIFF by suffix)")
    parser.add_argument("--store", help="activation store directory (default: a temp dir)")
    parser.add_argument("-v", action="store_true", help="show vLLM's warnings and loading bars")
    args = parser.parse_args()

    from probehook import LLM
    from probehook.models.segmenter import ENGINE_KWARGS, segmenter_path
    from probehook.store import ActivationStore

    work = Path(tempfile.mkdtemp(prefix="probehook-segment-"))
    image = Path(args.image) if args.image else synthetic_image(work / "input.png")
    out = Path(args.out) if args.out else work / "mask.png"
    store = Path(args.store) if args.store else work / "store"
    fmt = "tiff" if out.suffix.lower() in (".tif", ".tiff") else "png"

    with LLM(str(segmenter_path()), layers=[0, 2], store=store, **ENGINE_KWARGS, **QUIET) as llm:
        data = {"image": str(image), "output_path": str(out), "format": fmt}
        (result,) = llm.encode({"data": data}, pooling_task="plugin", use_tqdm=False)
        mask = result.outputs
        height, width = mask["shape"]
        print(f"{image.name}: {height}x{width} pixels in {len(mask.patches)} patches")
        for name, count in zip(mask["classes"], mask["counts"], strict=True):
            print(f"  {name:<10} {count:5d} pixels")
        print(f"mask written to {mask['path']}")
        first = mask.patches[0]
        for layer, rows in first.hidden_states.items():
            print(f"patch 0, layer {layer}: rows {tuple(rows.shape)} (one per pixel)")
    reader = ActivationStore.open(store)
    stored = reader[first.store_id]
    print(
        f"store {store}: {len(reader)} patch requests; patch {stored.record['patch']} of "
        f"{stored.record['user_request']} has layers {sorted(stored.prefill_hidden_states)}"
    )


if __name__ == "__main__":
    main()
