"""Export an activation store to the files SAE trainers read (see docs/exports.md).

- :func:`export_saelens`: SAELens's cached-activations layout (a Hugging Face ``datasets``
  folder, as ``sae_lens.cache_activations_runner.CacheActivationsRunner`` writes it), which
  ``sae_lens.training.activations_store.ActivationsStore`` trains from with
  ``cached_activations_path=`` and no conversion step.
- :func:`export_safetensors`: safetensors shards holding ``token_ids [tokens]`` and
  ``hidden_states [tokens, n_layers, hidden]``, the two tensors vLLM's own hidden-state
  extraction (``ExampleHiddenStatesConnector``) writes per request, with request offsets in
  each shard's metadata and a ``manifest.json`` beside the shards.

Only the exported layers are read, through ``store.layer(...)``, and rows are written as they
come, so memory is bounded by one write batch (SAELens) or one shard (safetensors), never by
the store. Every export is written into a temporary folder beside the target and renamed into
place at the end: a crash leaves no half export under the target's name.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterator, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from probehook.errors import MissingExtraError
from probehook.store.layer_matrix import LayerMatrix
from probehook.store.reader import StoreReader

logger = logging.getLogger(__name__)

EXPORT_PHASES = ("prefill", "decode", "all")
PACKINGS = ("concat", "request")
DEFAULT_HOOK_NAME = "blocks.{layer}.hook_resid_post"
"""TransformerLens's name for what probehook captures after decoder layer ``L``: the residual
stream after block ``L`` (Hugging Face ``hidden_states[L + 1]``)."""
SUMMARY_FILE = "probehook_export.json"
"""Written inside a SAELens export (``datasets`` ignores it): source, options and counts."""
SAFETENSORS_MANIFEST = "manifest.json"
EXPORT_FORMAT_VERSION = 1
DEFAULT_SHARD_TOKENS = 32768
DEFAULT_ARROW_SHARD_BYTES = 500 << 20  # datasets' own default max_shard_size ("500MB")
WRITE_BATCH_BYTES = 64 << 20
READ_BLOCK_BYTES = 32 << 20  # per exported layer and phase


# -- planning: what to read, from the manifest alone -----------------------------------------


@dataclass
class _Piece:
    """Rows ``skip:count`` of one stored segment; ``rows[layer]`` is where the segment
    begins in ``store.layer(layer, phase)``."""

    phase: str
    first_position: int
    count: int
    skip: int
    rows: dict[int, int]


@dataclass
class _Sequence:
    """One exported token sequence: a request's prompt, or one completion of it."""

    record: dict[str, Any] = field(repr=False)  # the store's own record, not a copy
    completion: int | None
    pieces: list[_Piece] = field(default_factory=list)

    @property
    def store_id(self) -> str:
        return self.record["id"]

    @property
    def length(self) -> int:
        return sum(p.count - p.skip for p in self.pieces)

    def token_ids(self) -> np.ndarray:
        """The input token at each exported row's position: the prompt's token ids, then the
        completion's, indexed by position (read from the record only when written, so a plan
        of a big store holds no token lists)."""
        tokens = list(self.record["prompt_token_ids"])
        if self.completion is not None:
            done = {c["index"]: c for c in self.record["completions"]}
            tokens += done[self.completion]["token_ids"]
        positions = np.concatenate(
            [np.arange(p.first_position + p.skip, p.first_position + p.count) for p in self.pieces]
        )
        if positions.size and positions.max() >= len(tokens):
            raise RuntimeError(
                f"probehook export: request {self.store_id} has rows up to position "
                f"{positions.max()} but only {len(tokens)} prompt and output tokens."
            )
        return np.asarray(tokens, dtype=np.int64)[positions]


@dataclass
class _Plan:
    sequences: list[_Sequence]
    skipped: list[str]
    """Requests with rows of some but not all exported layers (runs that captured other
    layers); they are left out and named in the summary."""
    matrices: dict[tuple[int, str], LayerMatrix]
    """``store.layer(layer, phase)`` of each exported layer and stored phase read."""


def _segments(record: dict[str, Any], layer: int, phase: str) -> list[dict[str, Any]]:
    return [
        s
        for s in record["segments"]
        if s["layer"] == layer and s["phase"] == phase and s["count"] > 0
    ]


def _phases(phase: str) -> tuple[str, ...]:
    return ("prefill", "decode") if phase == "all" else (phase,)


def _plan(store: StoreReader, layers: list[int], phase: str) -> _Plan:
    """The sequences to export and, for each of their segments, its first row in every
    ``store.layer(L, P)``. That matrix holds every request's (L, P) segments, requests in store
    order and segments in record order (docs/store.md: ``= store.layer(LAYER, PHASE)[:]``);
    the walk below counts rows in the same order and checks the totals at the end."""
    phases = _phases(phase)
    cursor = {(layer, p): 0 for layer in layers for p in phases}
    sequences: list[_Sequence] = []
    skipped: list[str] = []
    for request in store.requests:
        record = request.record
        rid = record["id"]
        per_layer = {}
        starts: dict[int, int] = {}  # id(segment) -> its first row in its matrix
        for layer in layers:
            segs = {p: _segments(record, layer, p) for p in phases}
            per_layer[layer] = segs
            for p in phases:
                # every segment advances its matrix's cursor, exported or not
                for s in segs[p]:
                    starts[id(s)] = cursor[(layer, p)]
                    cursor[(layer, p)] += s["count"]

        def shape(layer: int, per_layer: dict = per_layer) -> list[tuple]:
            return [
                (s["phase"], s["completion"], s["first_position"], s["count"])
                for p in phases
                for s in per_layer[layer][p]
            ]

        first = shape(layers[0])
        if not first or any(shape(layer) != first for layer in layers[1:]):
            # rows of this phase in some layer, but not the same rows in every exported one
            if any(s["phase"] in phases and s["count"] > 0 for s in record["segments"]):
                skipped.append(rid)
            continue

        def piece(
            p: str, i: int, skip: int, per_layer: dict = per_layer, starts: dict = starts
        ) -> _Piece:
            s = per_layer[layers[0]][p][i]
            rows = {layer: starts[id(per_layer[layer][p][i])] for layer in layers}
            return _Piece(p, s["first_position"], s["count"], skip, rows)

        prefill = per_layer[layers[0]].get("prefill", [])
        prefill_end = max((s["first_position"] + s["count"] for s in prefill), default=0)
        request_seqs: list[_Sequence] = []
        if prefill:
            request_seqs.append(
                _Sequence(record, None, [piece("prefill", i, 0) for i in range(len(prefill))])
            )
        if "decode" in phases:
            decode = per_layer[layers[0]]["decode"]
            for completion in record["completions"]:
                index = completion["index"]
                pieces = []
                for i, s in enumerate(decode):
                    if s["completion"] != index:
                        continue
                    # Phase "all": decode rows at positions the prefill rows already cover
                    # (decode row 0 is the last prompt position, equal to its prefill row)
                    # are left out.
                    skip = min(s["count"], max(0, prefill_end - s["first_position"]))
                    if skip < s["count"]:
                        pieces.append(piece("decode", i, skip))
                if not pieces:
                    continue
                if request_seqs and request_seqs[0].completion is None and index == 0:
                    # the prompt's rows and the first completion's rows are one sequence
                    request_seqs[0].completion = 0
                    request_seqs[0].pieces += pieces
                else:
                    request_seqs.append(_Sequence(record, index, pieces))
        sequences += request_seqs
    matrices = {key: store.layer(*key) for key in cursor}
    for (layer, p), total in cursor.items():
        matrix_rows = len(matrices[(layer, p)])
        if total != matrix_rows:
            raise RuntimeError(
                f"probehook export: the manifest gives {total} {p} rows of layer {layer} but "
                f"store.layer() has {matrix_rows}; the store's row order is not the documented "
                "one, so rows could not be matched with their tokens."
            )
    return _Plan(sequences, skipped, matrices)


# -- reading --------------------------------------------------------------------------------


class _Window:
    """Rows of one matrix read a block at a time. Sequences ask for rows in ascending order,
    so one read of ``block_rows`` serves many small requests: a read of a few rows would
    still read whole HDF5 chunks (the store reads without a chunk cache)."""

    def __init__(self, matrix: LayerMatrix, block_rows: int) -> None:
        self.matrix, self.block_rows = matrix, block_rows
        self.lo = self.hi = 0
        self.buf: torch.Tensor | None = None

    def get(self, start: int, stop: int) -> torch.Tensor:
        if self.buf is None or start < self.lo or stop > self.hi:
            self.lo = start
            self.hi = min(len(self.matrix), max(stop, start + self.block_rows))
            self.buf = None  # free the old block before reading the next
            self.buf = self.matrix[self.lo : self.hi]
        return self.buf[start - self.lo : stop - self.lo]


class _Reader:
    """Rows of the planned sequences, ``[length, n_layers, hidden]`` in the store's dtype."""

    def __init__(self, plan: _Plan, layers: list[int], hidden: int, itemsize: int) -> None:
        block_rows = max(1, READ_BLOCK_BYTES // (hidden * itemsize))
        self.layers = layers
        self.windows = {key: _Window(m, block_rows) for key, m in plan.matrices.items()}

    def fill(self, seq: _Sequence, out: torch.Tensor) -> None:
        """Copy the first ``len(out)`` rows of ``seq`` into ``out`` ``[n, n_layers, hidden]``
        (any dtype: one copy converts)."""
        for i, layer in enumerate(self.layers):
            at = 0
            for p in seq.pieces:
                if at >= len(out):
                    break
                start = p.rows[layer] + p.skip
                stop = min(p.rows[layer] + p.count, start + len(out) - at)
                part = self.windows[(layer, p.phase)].get(start, stop)
                _copy_rows(out[at : at + len(part), i], part)
                at += len(part)


_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _copy_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for row blocks, done by numpy on this thread. torch's copy runs on its
    intra-op thread pool, which on a busy machine (more runnable threads than cores) made
    many small copies about 100x slower. bfloat16 -> float32 is exact: the bfloat16 bits are
    the float32's top half."""
    if dst.dtype == src.dtype:
        as_int = _SAME_SIZE_INT[dst.element_size()]
        np.copyto(dst.view(as_int).numpy(), src.view(as_int).numpy())
    elif dst.dtype == torch.float32 and src.dtype == torch.bfloat16:
        bits = dst.view(torch.int32).numpy().view(np.uint32)
        bits[...] = src.view(torch.int16).numpy().view(np.uint16)
        bits <<= 16
    else:
        dst.copy_(src)


# -- shared checks and atomic output ---------------------------------------------------------


def _open(store: StoreReader | str | os.PathLike[str]) -> StoreReader:
    # An ActivationStore is a StoreReader; a path is opened read-only.
    return store if isinstance(store, StoreReader) else StoreReader.open(store)


def _check_target(path: Path) -> None:
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(
            f"The export target {path} already exists and is not an empty folder; an export "
            "never overwrites or adds to one. Pick a new path (or delete the old export)."
        )


def _check_layers(store: StoreReader, layers: Sequence[int]) -> list[int]:
    layers = [int(layer) for layer in layers]
    if not layers:
        raise ValueError(f"No layers to export; the store at {store.root} holds {store.layers}.")
    if len(set(layers)) != len(layers):
        raise ValueError(f"layers={layers} names a layer more than once.")
    missing = [layer for layer in layers if layer not in store.layers]
    if missing:
        raise ValueError(
            f"Layer(s) {missing} are not in the store at {store.root}; its runs captured "
            f"layers {store.layers}."
        )
    return layers


def _checked_plan(store: StoreReader, layers: list[int], phase: str) -> _Plan:
    if phase not in EXPORT_PHASES:
        raise ValueError(f"phase={phase!r}; valid phases are {EXPORT_PHASES}.")
    plan = _plan(store, layers, phase)
    if not plan.sequences:
        held = {
            p: len(plan.matrices[(layers[0], p)])
            if (layers[0], p) in plan.matrices
            else len(store.layer(layers[0], p))
            for p in ("prefill", "decode")
        }
        raise ValueError(
            f"The store at {store.root} has no {phase} rows of layer(s) {layers} to export: it "
            f"holds {held['prefill']} prefill and {held['decode']} decode rows of layer "
            f"{layers[0]} ({len(store)} requests"
            + (
                f"; {len(plan.skipped)} of them lack some of layers {layers}"
                if plan.skipped
                else ""
            )
            + "). "
            + (
                "Capture with include_prefill=True for prompt rows, or pick phase='decode'."
                if phase == "prefill"
                else "Capture with include_decode=True for decode rows, or pick phase='prefill'."
                if phase == "decode"
                else "Capture rows first."
            )
        )
    return plan


class _AtomicDir:
    """A temporary folder beside ``target``, renamed to ``target`` by :meth:`commit`; removed
    if the export fails. An empty folder already at ``target`` is replaced."""

    def __init__(self, target: Path) -> None:
        self.target = target
        self.tmp = target.parent / f".{target.name}.partial-{uuid.uuid4().hex[:8]}"

    def __enter__(self) -> Path:
        self.target.parent.mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir()
        return self.tmp

    def commit(self) -> None:
        for entry in self.tmp.iterdir():
            if entry.is_file():
                _fsync(entry)
        _fsync(self.tmp)
        _check_target(self.target)  # again: something may have appeared meanwhile
        os.replace(self.tmp, self.target)  # a directory replaces only an empty one
        _fsync(self.target.parent)

    def __exit__(self, *exc: object) -> None:
        if self.tmp.exists():
            shutil.rmtree(self.tmp, ignore_errors=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        with suppress(OSError):  # some file systems refuse fsync on a directory
            os.fsync(fd)
    finally:
        os.close(fd)


def _progress(total: int, desc: str, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="tok", unit_scale=True, disable=not enabled)


def _source(store: StoreReader) -> dict[str, Any]:
    meta = store.meta
    return {
        "store": str(Path(store.root).resolve()),
        "model": meta.get("model"),
        "model_fingerprint": meta.get("model_fingerprint"),
        "fingerprint_version": meta.get("fingerprint_version"),
        "store_dtype": meta.get("dtype"),
        "hidden_size": store.hidden_size,
        "requests": len(store),
    }


# -- SAELens --------------------------------------------------------------------------------


EXPORT_OPTIONS: dict[str, dict[str, str]] = {
    # format -> the options it needs, each with what it means (the first line of every error)
    "saelens": {
        "layer": "the layer whose rows become the activations",
        "context_size": "tokens per context, as SAELens's context_size (e.g. 128)",
    },
    "safetensors": {"layers": "the layers to stack per token, in order (e.g. [3])"},
}


def export_writer(format: str) -> Any:
    """The function that writes ``format`` (a key of :data:`EXPORT_OPTIONS`)."""
    return {"saelens": export_saelens, "safetensors": export_safetensors}[format]


def export_option_names(format: str) -> list[str]:
    """Every option ``format``'s writer takes, in its signature's order."""
    import inspect

    names = inspect.signature(export_writer(format)).parameters
    return [name for name in names if name not in ("store", "path")]


def check_export_options(format: str, options: dict[str, Any], layers: Sequence[int]) -> None:
    """Refuse, before anything is written, an unknown format, a missing option (naming each
    and its meaning) or one the format does not take (naming those it does)."""
    if format not in EXPORT_OPTIONS:
        raise ValueError(
            f"format={format!r} is not an export format; choose one of {sorted(EXPORT_OPTIONS)}."
        )
    accepted = export_option_names(format)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise TypeError(
            f"export format {format!r} takes no option(s) {unknown}; its options are {accepted}."
        )
    missing = [name for name in EXPORT_OPTIONS[format] if name not in options]
    if missing:
        needs = "; ".join(f"{name}= ({EXPORT_OPTIONS[format][name]})" for name in missing)
        example = {
            "layer": layers[0] if layers else 0,
            "context_size": 128,
            "layers": list(layers[:1]),
        }
        shown = ", ".join(f"{n}={example[n]!r}" for n in EXPORT_OPTIONS[format])
        raise TypeError(
            f"export format {format!r} needs {needs}. This store's layers are {list(layers)}. "
            f"For example: store.export(path, format={format!r}, {shown})."
        )


def export_saelens(
    store: StoreReader | str | os.PathLike[str],
    path: str | os.PathLike[str],
    *,
    layer: int,
    context_size: int,
    hook_name: str | None = None,
    phase: str = "prefill",
    packing: str = "concat",
    shard_bytes: int = DEFAULT_ARROW_SHARD_BYTES,
    progress: bool = True,
) -> Path:
    """Write one layer's rows as SAELens cached activations; return the folder.

    The folder is a Hugging Face ``datasets`` dataset (``datasets.load_from_disk``) laid out
    as SAELens's ``CacheActivationsRunner`` writes it: one row per context, column
    ``hook_name`` (``Array2D((context_size, hidden_size), "float32")``) and ``token_ids``
    (``Sequence(Value("int32"), length=context_size)``), ``dataset_info.json``, ``state.json``
    and ``data-XXXXX-of-YYYYY.arrow`` files of about ``shard_bytes`` each. Point SAELens at it
    with ``use_cached_activations=True, cached_activations_path=PATH`` and the same
    ``hook_name``, ``context_size`` and ``d_in = store.hidden_size``.

    ``phase``: ``"prefill"`` (prompt rows), ``"decode"`` (each completion's rows) or ``"all"``
    (prompt rows, then the first completion's rows at the positions after the prompt; other
    completions follow as their own sequences). ``token_ids`` holds each row's input token
    (the token at that position), as SAELens does.

    ``packing="concat"`` (SAELens's default for a text dataset it tokenizes): every sequence's
    rows, in store order, are concatenated and cut into contexts of ``context_size`` rows;
    the last ``< context_size`` rows are left out. ``packing="request"`` (SAELens's
    ``disable_concat_sequences=True``): one context per sequence, its first ``context_size``
    rows; shorter sequences are left out. What is left out is logged and counted in
    ``probehook_export.json`` (in the folder). bfloat16/float16 rows are converted to
    float32 exactly.
    """
    store = _open(store)
    target = Path(path)
    if packing not in PACKINGS:
        raise ValueError(f"packing={packing!r}; valid values are {PACKINGS}.")
    if isinstance(context_size, bool) or int(context_size) != context_size or context_size < 1:
        raise ValueError(f"context_size={context_size!r}; it must be an integer of at least 1.")
    context_size = int(context_size)
    if shard_bytes < 1:
        raise ValueError(f"shard_bytes={shard_bytes}; it must be positive.")
    try:
        import datasets
        import pyarrow as pa
    except ImportError as e:
        raise MissingExtraError(
            "export_saelens writes a Hugging Face `datasets` folder and needs the `datasets` "
            "package: pip install 'probehook[hf]'"
        ) from e
    _check_target(target)
    (layer,) = _check_layers(store, [layer])
    hook_name = hook_name if hook_name is not None else DEFAULT_HOOK_NAME.format(layer=layer)
    if hook_name == "token_ids":
        raise ValueError("hook_name='token_ids' would collide with the token_ids column.")
    plan = _checked_plan(store, [layer], phase)
    hidden = store.hidden_size
    lengths = [s.length for s in plan.sequences]
    total = sum(lengths)
    if packing == "concat":
        n_contexts = total // context_size
    else:
        n_contexts = sum(1 for n in lengths if n >= context_size)
    if n_contexts == 0:
        raise ValueError(
            f"No context of {context_size} tokens can be cut from the store at {store.root}: "
            f"its {len(lengths)} {phase} sequences of layer {layer} hold {total} rows "
            f"(longest {max(lengths)}), packing={packing!r}. Use a smaller context_size"
            + (" or packing='concat'." if packing == "request" else ".")
        )
    if context_size * hidden >= 2**31:
        raise ValueError(
            f"context_size * hidden_size = {context_size * hidden} values per context; Arrow's "
            "list offsets (int32) hold fewer than 2**31. Use a smaller context_size."
        )

    features = datasets.Features(
        {
            hook_name: datasets.Array2D(shape=(context_size, hidden), dtype="float32"),
            "token_ids": datasets.Sequence(datasets.Value("int32"), length=context_size),
        }
    )
    schema = features.arrow_schema
    act_type = schema.field(hook_name).type
    context_bytes = context_size * hidden * 4
    batch_contexts = max(1, WRITE_BATCH_BYTES // context_bytes)

    def contexts() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``(rows [k, context_size, hidden] float32, token_ids [k, context_size])`` blocks."""
        reader = _Reader(plan, [layer], hidden, store.dtype.itemsize)
        rows_buf = np.empty((batch_contexts * context_size, hidden), dtype=np.float32)
        ids_buf = np.empty(batch_contexts * context_size, dtype=np.int64)
        filled = 0
        for seq in plan.sequences:
            if packing == "request" and seq.length < context_size:
                continue
            n = context_size if packing == "request" else seq.length
            seq_rows = torch.empty((n, 1, hidden), dtype=torch.float32)
            reader.fill(seq, seq_rows)  # bfloat16/float16 -> float32: exact
            rows = seq_rows[:, 0].numpy()
            ids = seq.token_ids()[:n]
            at = 0
            while at < len(rows):
                take = min(len(rows) - at, len(ids_buf) - filled)
                rows_buf[filled : filled + take] = rows[at : at + take]
                ids_buf[filled : filled + take] = ids[at : at + take]
                filled += take
                at += take
                if filled == len(ids_buf):
                    yield (
                        rows_buf.reshape(batch_contexts, context_size, hidden),
                        ids_buf.reshape(batch_contexts, context_size),
                    )
                    filled = 0
        whole = filled // context_size * context_size
        if whole:
            yield (
                rows_buf[:whole].reshape(-1, context_size, hidden),
                ids_buf[:whole].reshape(-1, context_size),
            )

    def record_batch(rows: np.ndarray, ids: np.ndarray) -> Any:
        k = len(rows)
        values = pa.array(rows.reshape(-1), pa.float32())
        inner = pa.ListArray.from_arrays(
            pa.array(np.arange(k * context_size + 1, dtype=np.int32) * hidden), values
        )
        outer = pa.ListArray.from_arrays(
            pa.array(np.arange(k + 1, dtype=np.int32) * context_size), inner
        )
        if ids.size and (ids.min() < np.iinfo(np.int32).min or ids.max() > np.iinfo(np.int32).max):
            raise ValueError("A token id does not fit SAELens's int32 token_ids column.")
        tokens = pa.FixedSizeListArray.from_arrays(
            pa.array(ids.reshape(-1).astype(np.int32), pa.int32()), context_size
        )
        return pa.RecordBatch.from_arrays(
            [pa.ExtensionArray.from_storage(act_type, outer), tokens], schema=schema
        )

    written = 0
    atomic = _AtomicDir(target)
    with atomic as tmp, _progress(n_contexts * context_size, "SAELens export", progress) as bar:
        parts: list[Path] = []
        sink = writer = None
        part_bytes = 0
        try:
            for rows, ids in contexts():
                if writer is None:
                    parts.append(tmp / f"part-{len(parts):05d}.arrow")
                    sink = pa.OSFile(os.fspath(parts[-1]), "wb")
                    writer = pa.ipc.new_stream(sink, schema)
                    part_bytes = 0
                writer.write_batch(record_batch(rows, ids))
                written += len(rows)
                part_bytes += rows.nbytes
                bar.update(rows.shape[0] * context_size)
                if part_bytes >= shard_bytes:
                    writer.close()
                    sink.close()
                    sink = writer = None
        finally:
            if writer is not None:
                writer.close()
            if sink is not None:
                sink.close()
        if written != n_contexts:
            raise RuntimeError(f"probehook export: wrote {written} contexts, planned {n_contexts}")
        names = []
        for i, part in enumerate(parts):
            name = f"data-{i:05d}-of-{len(parts):05d}.arrow"
            part.rename(tmp / name)
            names.append(name)
        digest = hashlib.sha256(
            json.dumps(
                [_source(store), layer, hook_name, phase, packing, context_size, written]
            ).encode()
        ).hexdigest()[:16]
        # As Dataset.save_to_disk writes them (datasets/arrow_dataset.py), which is what
        # CacheActivationsRunner._consolidate_shards copies.
        state = {
            "_data_files": [{"filename": n} for n in names],
            "_fingerprint": digest,
            "_format_columns": None,
            "_format_kwargs": {},
            "_format_type": None,
            "_output_all_columns": False,
            "_split": None,
        }
        (tmp / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
        info = datasets.DatasetInfo(features=features)
        info_dict = dataclasses.asdict(info)
        (tmp / "dataset_info.json").write_text(
            json.dumps({k: info_dict[k] for k in sorted(info_dict)}, indent=2)
        )
        dropped_short = sum(n for n in lengths if n < context_size) if packing == "request" else 0
        cut = (
            total - n_contexts * context_size - dropped_short
        )  # concat: the tail; request: rows past context_size
        summary = {
            "format": "saelens-cached-activations",
            "probehook_export_version": EXPORT_FORMAT_VERSION,
            "source": _source(store),
            "layer": layer,
            "hook_name": hook_name,
            "phase": phase,
            "packing": packing,
            "context_size": context_size,
            "d_in": hidden,
            "dtype": "float32",
            "contexts": n_contexts,
            "tokens": n_contexts * context_size,
            "sequences": len(lengths),
            "rows_available": total,
            "rows_left_out": total - n_contexts * context_size,
            "left_out": {
                "concat_tail_rows": cut if packing == "concat" else 0,
                "rows_past_context_size": cut if packing == "request" else 0,
                "short_sequences": sum(1 for n in lengths if n < context_size)
                if packing == "request"
                else 0,
                "short_sequence_rows": dropped_short,
                "requests_missing_layers": plan.skipped,
            },
            "token_ids": "the input token at each row's position",
        }
        (tmp / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
        _log_left_out("SAELens", target, summary)
        atomic.commit()
    return target


def _log_left_out(kind: str, target: Path, summary: dict[str, Any]) -> None:
    left = summary.get("rows_left_out", 0)
    skipped = summary["left_out"]["requests_missing_layers"]
    logger.info(
        "probehook %s export %s: %d tokens written; %d rows left out (%s)%s",
        kind,
        target,
        summary["tokens"],
        left,
        ", ".join(
            f"{k}={v}" for k, v in summary["left_out"].items() if k != "requests_missing_layers"
        ),
        f"; {len(skipped)} request(s) without every exported layer skipped" if skipped else "",
    )
    if skipped:
        logger.warning(
            "probehook %s export %s: %d request(s) lack some exported layer (captured by runs "
            "with other layers) and were left out: %s",
            kind,
            target,
            len(skipped),
            skipped[:10],
        )


# -- safetensors ----------------------------------------------------------------------------


def export_safetensors(
    store: StoreReader | str | os.PathLike[str],
    path: str | os.PathLike[str],
    *,
    layers: Sequence[int],
    phase: str = "prefill",
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    dtype: torch.dtype | None = None,
    progress: bool = True,
) -> list[Path]:
    """Write rows as safetensors shards in vLLM's hidden-state layout; return the shard paths.

    Each ``PATH/hidden_states-XXXXX-of-YYYYY.safetensors`` holds ``hidden_states``
    ``[tokens, len(layers), hidden]`` (layers stacked in the order given; the store's dtype,
    bfloat16 stays bfloat16, unless ``dtype``) and ``token_ids`` ``[tokens]`` int64 (each
    row's input token), as vLLM's ``ExampleHiddenStatesConnector`` saves one request. A shard
    holds whole sequences (a request's prompt, or a completion), about ``shard_tokens`` tokens
    (a longer sequence gets a shard of its own); its metadata says where each begins
    (``request_offsets``, ``store_ids``, ``completions``). ``PATH/manifest.json`` lists the
    shards, tokens, layers and the model fingerprint. ``phase`` is as for
    :func:`export_saelens`; ``"all"`` gives vLLM's ``include_output_tokens`` sequences.
    """
    from safetensors.torch import save_file

    store = _open(store)
    target = Path(path)
    if isinstance(shard_tokens, bool) or int(shard_tokens) != shard_tokens or shard_tokens < 1:
        raise ValueError(f"shard_tokens={shard_tokens!r}; it must be an integer of at least 1.")
    _check_target(target)
    layers = _check_layers(store, list(layers))
    plan = _checked_plan(store, layers, phase)
    out_dtype = dtype if dtype is not None else store.dtype
    hidden = store.hidden_size

    # Group whole sequences into shards of about shard_tokens tokens.
    groups: list[list[_Sequence]] = [[]]
    tokens_in = 0
    for seq in plan.sequences:
        if groups[-1] and tokens_in + seq.length > shard_tokens:
            groups.append([])
            tokens_in = 0
        groups[-1].append(seq)
        tokens_in += seq.length
    n = len(groups)
    total = sum(s.length for s in plan.sequences)
    reader = _Reader(plan, layers, hidden, store.dtype.itemsize)
    shards_meta = []
    atomic = _AtomicDir(target)
    with atomic as tmp, _progress(total, "safetensors export", progress) as bar:
        for i, group in enumerate(groups):
            count = sum(s.length for s in group)
            hs = torch.empty((count, len(layers), hidden), dtype=out_dtype)
            ids = torch.empty(count, dtype=torch.int64)
            offsets = [0]
            for seq in group:
                at = offsets[-1]
                reader.fill(seq, hs[at : at + seq.length])
                ids[at : at + seq.length] = torch.from_numpy(seq.token_ids())
                offsets.append(at + seq.length)
                bar.update(seq.length)
            name = f"hidden_states-{i:05d}-of-{n:05d}.safetensors"
            metadata = {
                "format": "pt",
                "probehook_export_version": str(EXPORT_FORMAT_VERSION),
                "layers": json.dumps(layers),
                "phase": phase,
                "request_offsets": json.dumps(offsets),
                "store_ids": json.dumps([s.store_id for s in group]),
                "completions": json.dumps([s.completion for s in group]),
                "model_fingerprint": str(store.meta.get("model_fingerprint")),
            }
            save_file({"hidden_states": hs, "token_ids": ids}, os.fspath(tmp / name), metadata)
            del hs, ids
            shards_meta.append(
                {
                    "file": name,
                    "tokens": count,
                    "sequences": len(group),
                    "first_sequence": sum(len(g) for g in groups[:i]),
                }
            )
        manifest = {
            "format": "probehook-safetensors-hidden-states",
            "probehook_export_version": EXPORT_FORMAT_VERSION,
            "layout": "vllm ExampleHiddenStatesConnector: hidden_states [tokens, layers, hidden], "
            "token_ids [tokens] int64",
            "source": _source(store),
            "layers": layers,
            "vllm_aux_hidden_state_layer_ids": [layer + 1 for layer in layers],
            "phase": phase,
            "dtype": str(out_dtype).removeprefix("torch."),
            "hidden_size": hidden,
            "tokens": total,
            "sequences": len(plan.sequences),
            "shards": shards_meta,
            "tokens_left_out": 0,
            "left_out": {"requests_missing_layers": plan.skipped},
        }
        (tmp / SAFETENSORS_MANIFEST).write_text(json.dumps(manifest, indent=2))
        _log_left_out("safetensors", target, {"tokens": total, "rows_left_out": 0, **manifest})
        atomic.commit()
    return [target / s["file"] for s in shards_meta]


def read_safetensors_export(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Yield each exported sequence of a :func:`export_safetensors` folder as
    ``{"store_id", "completion", "token_ids", "hidden_states"}`` (one shard in memory)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    root = Path(path)
    manifest = json.loads((root / SAFETENSORS_MANIFEST).read_text())
    for shard in manifest["shards"]:
        file = os.fspath(root / shard["file"])
        with safe_open(file, "pt") as f:
            meta = f.metadata()
        tensors = load_file(file)
        offsets = json.loads(meta["request_offsets"])
        ids = json.loads(meta["store_ids"])
        completions = json.loads(meta["completions"])
        for k, store_id in enumerate(ids):
            a, b = offsets[k], offsets[k + 1]
            yield {
                "store_id": store_id,
                "completion": completions[k],
                "token_ids": tensors["token_ids"][a:b],
                "hidden_states": tensors["hidden_states"][a:b],
            }
