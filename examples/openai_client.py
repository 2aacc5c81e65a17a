"""Read probe scores and hidden states from a ``probehook serve`` server with the official
``openai`` client, streaming and not.

python examples/openai_client.py                          # starts a server on the tiny model
python examples/openai_client.py BASE_URL PROBE LAYER     # e.g. http://localhost:8000/v1 truth 15

A request opts in with a ``probehook`` object in its body (``extra_body``); each choice (and
each streamed chunk) then carries a ``probehook`` field with the scores and rows of its own
tokens. Hidden states are base64 raw little-endian arrays; ``probehook.decode_array`` turns
them into numpy. A request without ``probehook`` gets an ordinary response.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import openai

from probehook import decode_array
from probehook.testing import ServerProcess


def main(base_url: str, probe: str, layer: int) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="unused")
    model = client.models.list().data[0].id
    ask = {"probehook": {"probes": [probe], "layers": [layer]}}

    # Not streaming: the whole completion's scores and rows on its choice.
    response = client.completions.create(
        model=model, prompt="12+7=", max_tokens=6, temperature=0, extra_body=ask
    )
    choice = response.choices[0]
    field = choice.model_extra["probehook"]
    rows = decode_array(field["hidden_states"][str(layer)])
    print(f"completion {choice.text!r}: layer {layer} rows {rows.shape} {rows.dtype}")
    print(f"  {probe} per token: {[round(s, 3) for s in field['probe_scores'][probe]]}")

    # Streaming: each chunk carries the scores and rows of the tokens it adds.
    print(f"stream (text, {probe} score, layer {layer} row norm):")
    stream = client.completions.create(
        model=model, prompt="3+4=", max_tokens=6, temperature=0, stream=True, extra_body=ask
    )
    for chunk in stream:
        for choice in chunk.choices:
            field = (choice.model_extra or {}).get("probehook")
            if field:
                norms = decode_array(field["hidden_states"][str(layer)])
                for score, row in zip(field["probe_scores"][probe], norms, strict=True):
                    print(f"  {choice.text!r:8} {score:7.3f} {float((row**2).sum() ** 0.5):8.3f}")

    # Chat works the same way; an ordinary request is untouched.
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "5+5="}],
        max_tokens=4,
        temperature=0,
        extra_body={"probehook": {"probes": [probe]}},
    )
    scores = chat.choices[0].model_extra["probehook"]["probe_scores"][probe]
    print(f"chat {chat.choices[0].message.content!r}: {len(scores)} {probe} scores")
    plain = client.completions.create(model=model, prompt="1+1=", max_tokens=2)
    extended = "probehook" in (plain.choices[0].model_extra or {})
    print(f"ordinary request: extension field present: {extended}")


def serve_tiny_model(work: Path) -> ServerProcess:
    """Start ``probehook serve`` on the bundled tiny model with a stand-in probe: the
    projection of layer 3 on a random unit direction (train real ones with probehook.probes)."""
    import torch

    from probehook import LinearProbe, tiny_model_path

    direction = torch.nn.functional.normalize(torch.randn(1, 128, generator=torch.Generator()))
    probe = LinearProbe(direction, torch.zeros(1), layer=3, kind="regression", name="direction")
    path = probe.save(work / "direction.safetensors")
    (work / "chat.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    server = ServerProcess(
        [str(tiny_model_path()), "--layers", "3", "--probe", f"direction={path}"]
        + ["--chat-template", str(work / "chat.jinja"), "--max-model-len", "64"],
        log=work / "server.log",
    )
    print(f"starting probehook serve (log: {server.log}) ...", flush=True)
    return server.wait()


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    else:
        with tempfile.TemporaryDirectory() as work:
            server = serve_tiny_model(Path(work))
            try:
                main(server.base_url, "direction", 3)
            finally:
                server.stop()
