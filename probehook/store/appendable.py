"""May this run append to that store? Only a store of the same model: same fingerprint (see
:mod:`probehook.store.fingerprint`), hidden size and dtype; or a new or empty directory.

A run's SAEs are compared with those of the store's earlier runs (:func:`compare_saes`), not
refused: a run may store features under a name an earlier run used for another SAE, d_sae or
k. Stored features are kept apart by layout (store/features.py: a run of another index type,
width or value type never shares a dataset with it, in a shard or after ``compact``), and a
request's features are its own run's SAE's (the run's description of that stored name). What is
refused, with a :class:`~probehook.errors.StoreError` naming the SAE, is a description the
store cannot lay out (:func:`check_saes`)."""

from __future__ import annotations

import logging
import operator
from pathlib import Path
from typing import Any

from probehook.errors import StoreError, StoreFormatError
from probehook.outputs.top_k import RUN_TOP_K_KEY
from probehook.store.contents import read_meta
from probehook.store.features import MAX_D_SAE
from probehook.store.format import (
    CREATE_LOCK,
    META_FILE,
    WRITER_LOCK,
    lane_dir,
    list_lanes,
)
from probehook.store.manifest import scan_manifest

logger = logging.getLogger(__name__)
SAE_IDENTITY = ("fingerprint", "d_sae", "k", "layer")
"""What :func:`compare_saes` compares of two runs' SAEs of one name."""


def check_appendable(
    path: str | Path,
    meta: dict[str, Any],
    *,
    legacy_fingerprint: str | None = None,
    top_k: dict[str, Any] | None = None,
) -> None:
    """Raise unless ``path`` is new, empty, or a store of the same model (the keys of
    ``meta`` that it has: model_fingerprint, hidden_size, dtype).

    Fingerprints are compared only within one ``fingerprint_version`` (a missing one is
    version 1, the legacy whole-config hash). A legacy store accepts a run whose
    ``legacy_fingerprint`` matches it; anything else is refused with what to do.

    ``top_k``: the run's top-k instances (SAEs: ``{name: {"d_sae", "k", "fingerprint",
    "layer", ...}}``, as ``begin_run`` records them), checked (:func:`check_saes`) and
    compared with the store's earlier runs: an SAE, d_sae or k that differs from an earlier
    run's under the same name is allowed and logged (INFO), since features of other layouts
    are stored apart.
    """
    root = Path(path)
    # A writer creating the store right now writes meta.json before anything else it adds:
    # entries seen beside no meta.json are foreign only if meta.json is still absent after.
    foreign = (
        not (root / META_FILE).exists()
        and root.exists()
        and (
            not root.is_dir()
            # Lock files, and meta.json being written by a writer creating the store now.
            or any(
                p.name not in (WRITER_LOCK, CREATE_LOCK, META_FILE + ".tmp") for p in root.iterdir()
            )
        )
    )
    if foreign and not (root / META_FILE).exists():
        raise StoreFormatError(
            f"{root} exists, is not empty and is not an activation store; pick a new path."
        )
    if (root / META_FILE).exists():
        existing = read_meta(root)
        if "model_fingerprint" in meta:
            check_fingerprint(root, existing, meta, legacy_fingerprint)
        for key in ("hidden_size", "dtype"):
            if key in meta and existing.get(key) != meta[key]:
                raise StoreFormatError(
                    f"Cannot append to {root}: its {key} is {existing.get(key)!r} but this "
                    f"run's is {meta[key]!r}. Use a new store path for another model."
                )
        if top_k is not None:
            check_saes(root, top_k)
            for note in compare_saes(_runs(root), top_k):
                logger.info("probehook store %s: %s", root, note)
    elif top_k is not None:
        check_saes(root, top_k)


def check_saes(root: str | Path, described: Any) -> None:
    """Raise :class:`StoreError`, naming the SAE, unless every description in ``described``
    (``{name: {"d_sae", "k", ...}}``) is one whose features the store can lay out: a
    non-empty name, ``d_sae`` from 1 to :data:`~probehook.store.features.MAX_D_SAE` (indices
    and the padding mark fit in uint32), ``k`` at least 1."""
    if not isinstance(described, dict):
        raise StoreError(
            f"Cannot store SAE features in {root}: a run's SAEs must be a dict name -> "
            f"description, not a {type(described).__name__}."
        )
    for name, sae in described.items():
        if not isinstance(name, str) or not name:
            raise StoreError(
                f"Cannot store features of SAE {name!r} in {root}: an SAE name must be a "
                "non-empty string."
            )
        if not isinstance(sae, dict):
            raise StoreError(
                f"Cannot store features of SAE {name!r} in {root}: its description is a "
                f"{type(sae).__name__}, not a dict with d_sae and k."
            )
        for key, top in (("d_sae", MAX_D_SAE), ("k", None)):
            value = sae.get(key)
            try:
                number = operator.index(value) if not isinstance(value, bool) else None
            except TypeError:
                number = None
            if number is None or number < 1 or (top is not None and number > top):
                bound = f"from 1 to {top:,}" if top is not None else "at least 1"
                raise StoreError(
                    f"Cannot store features of SAE {name!r} in {root}: its {key} is "
                    f"{value!r}; it must be an integer {bound}."
                )


def compare_saes(runs: dict[str, dict[str, Any]], described: dict[str, Any]) -> list[str]:
    """One line for each SAE of ``described`` whose name the latest earlier run in ``runs`` that
    used it gave another SAE (fingerprint), d_sae, k or layer: what changed, and that the
    store keeps both (empty when nothing changed)."""
    notes = []
    for name, sae in described.items():
        earlier = [
            (run_id, run[RUN_TOP_K_KEY][name])
            for run_id, run in runs.items()
            if isinstance(run.get(RUN_TOP_K_KEY), dict)
            and isinstance(run[RUN_TOP_K_KEY].get(name), dict)
        ]
        if not earlier or not isinstance(sae, dict):
            continue
        run_id, before = earlier[-1]
        changed = [
            f"{key} {before.get(key)} -> {sae.get(key)}"
            for key in SAE_IDENTITY
            if before.get(key) != sae.get(key)
        ]
        if changed:
            notes.append(
                f"SAE {name!r} differs from run {run_id}'s ({', '.join(changed)}); both are "
                "kept: features of another d_sae, k or value type are stored in datasets of "
                "their own, and a request's features are its run's SAE's (store.runs[run]"
                f"[{RUN_TOP_K_KEY!r}])"
            )
    return notes


def _runs(root: Path) -> dict[str, dict[str, Any]]:
    """The run records of every lane of the store at ``root``, in store order."""
    runs: dict[str, dict[str, Any]] = {}
    for lane in list_lanes(root)[0]:
        for record in scan_manifest(lane_dir(root, lane)).records:
            if record.get("kind") == "run":
                runs[record["run_id"]] = record
    return runs


def check_fingerprint(
    root: Path, existing: dict[str, Any], meta: dict[str, Any], legacy: str | None
) -> None:
    """Raise unless the run of ``meta`` is the model of the store whose meta is ``existing``
    (``legacy``: the run's fingerprint v1, for a store written before v2)."""
    stored, ours = existing.get("model_fingerprint"), meta["model_fingerprint"]
    stored_version = existing.get("fingerprint_version", 1)
    our_version = meta.get("fingerprint_version", 1)
    stored_covers = existing.get("fingerprint_covers", "the whole HF config (v1)")
    our_covers = meta.get("fingerprint_covers", "the whole HF config (v1)")
    if stored_version == our_version:
        if stored == ours:
            return
        raise StoreFormatError(
            f"Cannot append to {root}: its model_fingerprint is {stored!r} (covers: "
            f"{stored_covers}) but this run's is {ours!r} (covers: {our_covers}), so this "
            "is another model (or other weights). Use a new store path for another model."
        )
    if stored_version == 1 and legacy is not None and stored == legacy:
        logger.info(
            "probehook store %s predates fingerprint v2; appending because this run's "
            "legacy fingerprint %s matches it",
            root,
            legacy,
        )
        return
    if stored_version == 1:
        legacy_note = (
            f"this run's config hashes to {legacy!r} that way"
            if legacy is not None
            else "this run gave no legacy fingerprint to compare"
        )
        raise StoreFormatError(
            f"Cannot append to {root}: it predates fingerprint v2. Its model_fingerprint "
            f"{stored!r} is a hash of the whole HF config, transformers version included, "
            f"and {legacy_note}, so probehook cannot tell whether this is the same model. "
            f"This run's v2 model_fingerprint is {ours!r} (covers: "
            f"{our_covers}). Use a new store path; or, if you know it is the same model "
            "(e.g. only transformers was upgraded), adopt the new fingerprint by setting "
            f'"model_fingerprint": "{ours}", "fingerprint_version": {our_version} and '
            f'"fingerprint_covers" in {root / META_FILE}.'
        )
    raise StoreFormatError(
        f"Cannot append to {root}: its model_fingerprint {stored!r} is fingerprint version "
        f"{stored_version} (covers: {stored_covers}) but this run's {ours!r} is version "
        f"{our_version} (covers: {our_covers}); this probehook cannot compare them. Use a "
        "new store path, or a probehook release that writes version "
        f"{stored_version}."
    )
