"""vLLM names that moved between the vLLM versions probehook supports, resolved in one place.

Each entry of :data:`MOVED` lists the modules a name has lived in, newest first; the last is
its home in the oldest supported vLLM (0.32). :func:`resolve` imports the first module that
defines it. ``scripts/check_vllm_compat.py`` reads the same table to check a vLLM wheel
statically and to print what moved, so a new move is recorded here and nowhere else.

This module imports no vLLM at import time (the compat checker reads it without a vLLM).
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

TESTED_VLLM_VERSIONS = ("0.32", "0.33")
"""The vLLM release lines probehook is tested against (major.minor); any other version gets
one warning when a capturing engine is built."""


@dataclass(frozen=True)
class MovedName:
    name: str
    modules: tuple[str, ...]
    """Where the name lives, newest vLLM first; the last is the oldest supported version."""
    optional: bool = False
    """New in a later vLLM: absent in older versions, and code must do without it there."""


MOVED: dict[str, MovedName] = {
    entry.name: entry
    for entry in (
        # 0.33 renamed vllm.entrypoints.launchers.cli_args to vllm.entrypoints.common.cli_args
        MovedName(
            "make_arg_parser",
            ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.launchers.cli_args"),
        ),
        MovedName(
            "validate_parsed_serve_args",
            ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.launchers.cli_args"),
        ),
        # 0.33 moved it out of api_utils, which still exists (with other names)
        MovedName(
            "cli_env_setup",
            ("vllm.entrypoints.common.startup", "vllm.entrypoints.serve.utils.api_utils"),
        ),
        # new in 0.33: the /v1/embeddings handler of token_embed models
        MovedName(
            "ServingTokenEmbedding",
            ("vllm.entrypoints.pooling.token_embed.serving",),
            optional=True,
        ),
    )
}


def resolve(name: str) -> Any:
    """The object ``name`` of :data:`MOVED` from the installed vLLM: the first of its modules
    that defines it. An optional name that no module defines gives None; a required one an
    ``ImportError`` naming every place looked in and the installed vLLM version."""
    entry = MOVED[name]
    for module_name in entry.modules:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            # Only "this module does not exist here"; a broken import inside it propagates.
            if e.name is not None and module_name.startswith(e.name):
                continue
            raise
        if hasattr(module, name):
            return getattr(module, name)
    if entry.optional:
        return None
    raise ImportError(
        f"probehook cannot find vLLM's {name!r} in any of {list(entry.modules)} "
        f"(installed vLLM {_installed_version()}; tested: {', '.join(TESTED_VLLM_VERSIONS)}). "
        "Install a tested vLLM (pip install 'probehook[cuda]'), or run `make compat "
        "VLLM=<version>` to see what else moved."
    )


def _installed_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:  # noqa: BLE001 - only for an error message
        return "unknown"


_warned_version: str | None = None


def warn_if_untested(version: str | None = None) -> bool:
    """Log one warning per process when the installed vLLM (or ``version``) is not of a
    tested release line; True when it warned now."""
    global _warned_version
    if version is None:
        version = _installed_version()
    line = ".".join(version.split("+")[0].split(".")[:2])
    if line in TESTED_VLLM_VERSIONS or _warned_version is not None:
        return False
    _warned_version = version
    logger.warning(
        "probehook is tested with vLLM %s; this is vLLM %s. Capture may fail or be wrong "
        "where vLLM changed what probehook reads: run `make compat VLLM=%s` to check, or "
        "install a tested version (pip install 'probehook[cuda]').",
        " and ".join(TESTED_VLLM_VERSIONS),
        version,
        version,
    )
    return True
