"""``StoredRequest``: one request of a store, its tensors read lazily from its shard."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from probehook.outputs import registered_readouts
from probehook.outputs.top_k import (
    LABELS_KEY,
    SEGMENT_NAME_KEY,
    SEGMENT_SOURCE_KEY,
    UNSOURCED,
    TopKRows,
)
from probehook.store.features import from_storage
from probehook.store.format import split_shard_key

if TYPE_CHECKING:
    from probehook.store.reader import StoreReader


@dataclass
class StoredRequest:
    """One request as stored; tensors load lazily from its shard."""

    store: StoreReader = field(repr=False)
    record: dict[str, Any] = field(repr=False)

    @property
    def store_id(self) -> str:
        """This request's key in the store, unique across runs (``store[store_id]``)."""
        return self.record["id"]

    @property
    def request_id(self) -> str:
        """vLLM's ``request_id`` of the output it was stored from."""
        return self.record.get("request_id", self.record["id"])

    @property
    def run(self) -> str | None:
        """The run it was captured in (see ``ActivationStore.runs``)."""
        return self.record.get("run")

    @property
    def item_id(self) -> str | None:
        """The caller's id of the work item this request came from (the record's
        ``"item_id"``, set by a collector through ``extra``); None when absent."""
        return self.record.get("item_id")

    @property
    def lane(self) -> str:
        """The lane it is stored in (``""``: the root lane; see ``ActivationStore.lanes``)."""
        return split_shard_key(self.record["shard"])[0]

    @property
    def prompt(self) -> str | None:
        return self.record.get("prompt")

    @property
    def text(self) -> str:
        return self.record["completions"][0]["text"] if self.record["completions"] else ""

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.record["prompt_token_ids"]

    @property
    def output_token_ids(self) -> list[int]:
        return self.record["completions"][0]["token_ids"] if self.record["completions"] else []

    @property
    def finish_reason(self) -> str | None:
        done = self.record["completions"]
        return done[0]["finish_reason"] if done else None

    @property
    def steering(self) -> dict[str, Any] | None:
        """The first completion's steering (vectors and scales, phase, gate, ``start``: the
        first steered position), None if it was not steered."""
        done = self.record["completions"]
        return done[0].get("steering") if done else None

    @property
    def prefill_hidden_states(self) -> dict[int, torch.Tensor]:
        return self._rows("prefill", None)

    @property
    def hidden_states(self) -> dict[int, torch.Tensor]:
        return self._rows("decode", 0)

    @property
    def probe_scores(self) -> dict[str, torch.Tensor]:
        """Runtime probe scores of the first completion (one per generated token)."""
        return self.completion_probe_scores(0)

    @property
    def prefill_probe_scores(self) -> dict[str, torch.Tensor]:
        """Runtime probe scores of the prompt tokens (with ``include_prefill``)."""
        return _score_tensors(self.record.get("prefill_probe_scores"))

    def completion_probe_scores(self, index: int) -> dict[str, torch.Tensor]:
        done = self.record["completions"]
        return _score_tensors(done[index].get("probe_scores") if index < len(done) else None)

    @property
    def sae_features(self) -> dict[str, TopKRows]:
        """SAE features of the first completion's tokens, by SAE name
        (:class:`~probehook.SAEFeatures`, top-k rows)."""
        return self.completion_sae_features(0)

    @property
    def prefill_sae_features(self) -> dict[str, TopKRows]:
        """SAE features of the prompt tokens (with ``include_prefill``)."""
        return self.top_k(UNSOURCED, "prefill")

    def completion_sae_features(self, index: int) -> dict[str, TopKRows]:
        return self.top_k(UNSOURCED, "decode", index)

    def top_k(
        self, source: str, phase: str = "decode", completion: int | None = 0
    ) -> dict[str, TopKRows]:
        """The stored top-k rows of readout ``source`` (a registered top-k readout's source, an
        SAE's features' included), by instance name: a completion's decode tokens
        (``phase="decode"``, ``completion``) or the prompt's (``phase="prefill"``)."""
        completion = completion if phase == "decode" else None
        readout = registered_readouts().get(source)
        row_type = readout.row_type if readout is not None else TopKRows
        out = {}
        for seg in self.record.get("sae_segments", ()):
            if seg.get(SEGMENT_SOURCE_KEY, UNSOURCED) != source:
                continue
            if seg["phase"] == phase and seg["completion"] == completion:
                stored = seg[SEGMENT_NAME_KEY]
                start, stop = seg["start"], seg["start"] + seg["count"]
                parts = self.store._read_features(
                    self.record["shard"], phase, stored, start, stop, seg.get("layout")
                )
                rows = row_type.from_parts(*from_storage(parts), labels=seg.get(LABELS_KEY))
                out[_instance(readout, source, stored)] = rows.top(seg.get("k", rows.k))
        return out

    def readout(self, source: str, phase: str = "decode", completion: int | None = 0) -> Any:
        """The stored rows of top-k readout ``source`` as its outputs hold them: a lens's
        ``{"j": {4: LensRows}}``, as ``out.lens`` (:meth:`top_k` has them by flat instance
        name, ``"j@4"``); a readout this process has not registered: by flat name."""
        flat = self.top_k(source, phase, completion)
        readout = registered_readouts().get(source)
        return readout.present(flat) if readout is not None else flat

    def completion_hidden_states(self, index: int) -> dict[int, torch.Tensor]:
        return self._rows("decode", index)

    def _rows(self, phase: str, completion: int | None) -> dict[int, torch.Tensor]:
        out = {}
        for seg in self.record["segments"]:
            if seg["phase"] == phase and seg["completion"] == completion:
                out[seg["layer"]] = self.store._read(
                    self.record["shard"],
                    phase,
                    seg["layer"],
                    seg["start"],
                    seg["start"] + seg["count"],
                )
        return out


def _score_tensors(scores: dict[str, list] | None) -> dict[str, torch.Tensor]:
    return {name: torch.tensor(v, dtype=torch.float32) for name, v in (scores or {}).items()}


def _instance(readout: Any, source: str, stored: str) -> str:
    """An instance's name from its stored name (the readout's prefix off; a readout this
    process has not registered: ``"<source>:"`` off, as the default prefix)."""
    prefix = readout.stored_name("") if readout is not None else f"{source}:"
    return stored.removeprefix(prefix)
