"""The one exception family of probehook.

Every error a user can trigger derives from :class:`ProbehookError`. Configuration errors are
also ``ValueError`` so that code written against vLLM's own validation keeps working.
"""


class ProbehookError(Exception):
    """Base class of every error raised by probehook."""


class CaptureConfigError(ProbehookError, ValueError):
    """Bad capture options (layers, phases, per-request overrides)."""


class UnsupportedModelError(ProbehookError, ValueError):
    """The model's decoder layers cannot be located, so nothing can be tapped."""


class CaptureError(ProbehookError, RuntimeError):
    """Captured rows are missing or inconsistent; raised instead of returning partial data."""


class StoreError(ProbehookError, OSError):
    """The activation store cannot be written or read (disk full, permissions, corruption)."""

    lost: tuple[str, ...] = ()
    """After a write error: the store ids of the requests it dropped (added, not durable)."""


class StoreLockedError(StoreError):
    """Another writer holds the store's ``writer.lock``: one writer at a time may append."""


class StoreFormatError(ProbehookError, ValueError):
    """A path is not an activation store, or was written by an incompatible version."""


class DuplicateStoreIdError(ProbehookError, ValueError):
    """A request was added under a store id the store already has (or was given earlier in
    this run); a second record would shadow the first."""


class StoreCorruptError(StoreFormatError):
    """The store's manifest has a damaged line before good ones; appending would lose records.
    ``probehook store fsck PATH --repair`` rewrites it keeping every verifiable record."""


class MissingExtraError(ProbehookError, ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


class ProbeError(ProbehookError, ValueError):
    """A linear probe cannot be built, fitted, loaded or applied: bad shapes or options, bad
    labels for ``LinearProbe.fit``, a damaged probe file, or a probe for another model."""
