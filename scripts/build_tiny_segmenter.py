"""Train the tiny segmenter bundled in probehook/assets/tiny-segmenter (a few seconds on CPU).

Synthetic pixels, labelled by ``codec.label_pixels`` (dark -> background, else the dominant
channel); the network sees them quantised exactly as vLLM will (through token ids).
"""

from __future__ import annotations

import json

import numpy as np
import torch
from safetensors.torch import save_file

from probehook.models.segmenter.codec import (
    ASSET_DIR,
    CLASSES,
    SegmenterNet,
    SegmenterSpec,
    label_pixels,
    pixels_to_ids,
)

STEPS = 1500
BATCH = 1024


def main() -> None:
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    spec = SegmenterSpec()
    net = SegmenterNet(spec)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        pixels = rng.random((n, spec.channels))
        ids = torch.tensor(pixels_to_ids(pixels, spec))
        quantised = np.rint(pixels * (spec.levels - 1)) / (spec.levels - 1)
        return ids, torch.from_numpy(label_pixels(quantised))

    for _ in range(STEPS):
        ids, labels = batch(BATCH)
        loss = torch.nn.functional.cross_entropy(net(ids), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    ids, labels = batch(20000)
    with torch.no_grad():
        accuracy = float((net(ids).argmax(-1) == labels).float().mean())
    ASSET_DIR.mkdir(parents=True, exist_ok=True)
    state = {f"encoder.{k}": v.contiguous() for k, v in net.state_dict().items()}
    save_file(state, str(ASSET_DIR / "model.safetensors"))
    config = {
        "architectures": ["ProbehookTinySegmenter"],
        # transformers reads it as a BertConfig (no remote code); vLLM picks the model class
        # from "architectures" and the IO Processor plugin from "io_processor_plugin".
        "model_type": "bert",
        "io_processor_plugin": "probehook",
        **{f: getattr(spec, f) for f in SegmenterSpec.__dataclass_fields__},
        "vocab_size": spec.levels**spec.channels,
        "num_attention_heads": 1,
        "intermediate_size": 2 * spec.hidden_size,
        "max_position_embeddings": spec.patch_size**2,
        "id2label": dict(enumerate(CLASSES)),
        "torch_dtype": "float32",
    }
    (ASSET_DIR / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    report = {"steps": STEPS, "batch": BATCH, "held_out_pixel_accuracy": round(accuracy, 4)}
    (ASSET_DIR / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(report)


if __name__ == "__main__":
    main()
