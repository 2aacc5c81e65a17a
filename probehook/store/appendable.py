"""May this run append to that store? Only a store of the same model: same fingerprint (see
:mod:`probehook.store.fingerprint`), hidden size and dtype; or a new or empty directory."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from probehook.errors import StoreFormatError
from probehook.store.contents import read_meta
from probehook.store.format import CREATE_LOCK, META_FILE, WRITER_LOCK

logger = logging.getLogger(__name__)


def check_appendable(
    path: str | Path, meta: dict[str, Any], *, legacy_fingerprint: str | None = None
) -> None:
    """Raise unless ``path`` is new, empty, or a store of the same model (the keys of
    ``meta`` that it has: model_fingerprint, hidden_size, dtype).

    Fingerprints are compared only within one ``fingerprint_version`` (a missing one is
    version 1, the legacy whole-config hash). A legacy store accepts a run whose
    ``legacy_fingerprint`` matches it; anything else is refused with what to do.
    """
    root = Path(path)
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
    elif root.exists() and (
        not root.is_dir()
        # Lock files, and meta.json being written by a writer creating the store now.
        or any(p.name not in (WRITER_LOCK, CREATE_LOCK, META_FILE + ".tmp") for p in root.iterdir())
    ):
        raise StoreFormatError(
            f"{root} exists, is not empty and is not an activation store; pick a new path."
        )


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
