"""Labelled feature rows of one layer, read from an activation store a block at a time.

Only the selected rows stay in memory: ``token="last"`` reads one row per request (per
completion for decode) straight from the store; ``"mean"`` accumulates sums block by block;
``"all"`` keeps every row of the labelled requests.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tqdm.auto import tqdm

from probehook.errors import ProbeError

if TYPE_CHECKING:
    from probehook.store import ActivationStore, StoredRequest

logger = logging.getLogger(__name__)

Labels = Mapping[str, Any] | Callable[["StoredRequest"], Any]
"""A label per store id, or a function of the stored request; None leaves a request out."""

BLOCK_BYTES = 32 << 20
"""Rows are read from the store this many bytes (as float32) at a time."""
PROGRESS_MIN_BLOCKS = 4
"""A progress bar is shown only when reading takes at least this many blocks."""
MAX_IDS_SHOWN = 5


@dataclass
class Examples:
    """Feature rows of one layer with their requests and labels."""

    x: np.ndarray
    """``[examples, hidden]`` float32."""
    request_ids: np.ndarray
    """``[examples]`` store id of each example's request (the split groups)."""
    y: list[Any]
    """``[examples]`` label of each example (its request's)."""


class LabelSource:
    """Labels looked up per store id; a callable is called once per request (a sweep asks for
    the same requests on every layer)."""

    def __init__(self, labels: Labels) -> None:
        if not isinstance(labels, Mapping) and not callable(labels):
            raise ProbeError(
                "labels must be a dict from store id to label or a callable taking a "
                f"StoredRequest; got {type(labels).__name__}."
            )
        self._labels = labels
        self._cache: dict[str, Any] = {}
        self._keys_checked = False

    def resolve(self, store: ActivationStore, ids: list[str], where: str) -> dict[str, Any]:
        """The label of each of ``ids`` (None: left out); ``where`` names the rows for errors."""
        labels = self._labels
        if not isinstance(labels, Mapping):
            for sid in ids:
                if sid not in self._cache:
                    try:
                        self._cache[sid] = labels(store[sid])
                    except Exception as e:
                        raise ProbeError(f"labels(store[{sid!r}]) raised {e!r}") from e
            return {sid: self._cache[sid] for sid in ids}
        if not self._keys_checked:
            unknown = [k for k in labels if k not in store]
            if unknown:
                raise ProbeError(
                    f"{len(unknown)} label key(s) are not store ids of {store.root}: "
                    f"{_some(unknown)}. Keys are StoredRequest.store_id (output.store_id), "
                    "not vLLM request ids."
                )
            self._keys_checked = True
        missing = [sid for sid in ids if sid not in labels]
        if missing:
            raise ProbeError(
                f"labels has no entry for {len(missing)} of the {len(ids)} requests with "
                f"{where}: {_some(missing)}. Map a request to None to leave it out."
            )
        present = set(ids)
        unused = [k for k, v in labels.items() if v is not None and k not in present]
        if unused:
            logger.warning(
                "%d labelled request(s) have no %s and are not used: %s",
                len(unused),
                where,
                _some(unused),
            )
        return {sid: labels[sid] for sid in ids}


def collect_examples(
    store: ActivationStore,
    layer: int,
    phase: str,
    token: str,
    labels: LabelSource,
    progress: bool,
) -> Examples:
    """Read the labelled examples of one layer and phase, a block of rows at a time."""
    # token="last" reads one row per segment straight from the store; mean/all need every row.
    matrix = store.layer(layer, phase, "last" if token == "last" else "all")
    where = f"{phase} rows of layer {layer}"
    if len(matrix) == 0:
        hint = " (was it captured with include_prefill=True?)" if phase == "prefill" else ""
        raise ProbeError(f"{store.root} has no {where}{hint}.")
    index = matrix.index
    sids = index["store_id"]
    n = len(sids)
    # Segment = one request's rows of one completion. A new one starts at a new request or where
    # positions stop being consecutive (a request's next completion restarts after its prompt).
    if token == "last":
        segment = np.arange(n)
    else:
        pos = index["position"]
        starts = np.ones(n, dtype=bool)
        starts[1:] = (sids[1:] != sids[:-1]) | (pos[1:] != pos[:-1] + 1)
        segment = np.cumsum(starts) - 1
    ids = list(dict.fromkeys(sids.tolist()))
    label_of = labels.resolve(store, ids, where)
    keep_ids = {sid for sid in ids if label_of[sid] is not None}
    if not keep_ids:
        raise ProbeError(f"every request with {where} has the label None (left out).")
    keep = np.fromiter((sid in keep_ids for sid in sids), dtype=bool, count=n)

    hidden = store.hidden_size
    block = max(1, BLOCK_BYTES // (4 * hidden))
    n_blocks = math.ceil(n / block)
    if token == "mean":
        kept_segments = np.unique(segment[keep])
        compact = np.searchsorted(kept_segments, segment)  # row -> its example (if kept)
        sums = torch.zeros(len(kept_segments), hidden, dtype=torch.float64)
        counts = np.bincount(compact[keep], minlength=len(kept_segments))
        first_rows = np.searchsorted(segment, kept_segments)
        example_ids = sids[first_rows]
    else:
        x = np.empty((int(keep.sum()), hidden), dtype=np.float32)
        example_ids = sids[keep]
    filled = 0
    bar = tqdm(
        total=n,
        unit="row",
        desc=f"layer {layer} {phase} rows",
        disable=not progress or n_blocks < PROGRESS_MIN_BLOCKS,
    )
    with bar:
        for begin, rows in zip(range(0, n, block), matrix.iter_blocks(block), strict=True):
            end = begin + len(rows)
            mask = keep[begin:end]
            picked = rows[torch.from_numpy(mask)].float()  # bfloat16/float16 -> float32
            if token == "mean":
                sums.index_add_(0, torch.from_numpy(compact[begin:end][mask]), picked.double())
            else:
                x[filled : filled + len(picked)] = picked.numpy()
                filled += len(picked)
            bar.update(end - begin)
    if token == "mean":
        x = (sums / torch.from_numpy(counts)[:, None]).float().numpy()
    return Examples(x, example_ids, [label_of[sid] for sid in example_ids])


def _some(ids: list[str]) -> str:
    shown = ", ".join(repr(i) for i in ids[:MAX_IDS_SHOWN])
    return f"[{shown}{', ...' if len(ids) > MAX_IDS_SHOWN else ''}]"
