"""The write op: every intervention at one site of a layer (steering's additions, SAE clamps,
the next issue's ablations and patches), in one ``torch.library.custom_op``.

A site's writes are terms of registered kinds, applied in order to the layer's rows, each
reading its own fixed buffers (its per-token index and tables, written by the worker before
each forward pass) and its constant settings: ``spec`` names them (:func:`write_spec`), and
the op's ``tensors`` hold every term's buffers one after the other. Like the tap it stays one
opaque call in vLLM's compiled graph and reads only fixed buffers, so changing what requests
ask never recompiles, and CUDA-graph replay writes whatever the buffers hold at replay time.

A kind is a function ``kind(hidden, residual, tensors, settings)`` that adds into ``hidden``
in place (``hidden + residual`` is the stream: adding to ``hidden`` adds to their sum),
registered with :func:`write_kind`. Steering's ``"add"`` (``probehook.worker.steer_op``) and
SAE clamping's ``"clamp"`` (``probehook.worker.clamp_op``) are the first two.

No vLLM imports.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from probehook.worker.tap_op import OP_NAMESPACE

WriteKind = Callable[[torch.Tensor, "torch.Tensor | None", Sequence[torch.Tensor], str], None]
WRITE_KINDS: dict[str, WriteKind] = {}
"""The registered kinds by name (:func:`write_kind`)."""


def write_kind(name: str) -> Callable[[WriteKind], WriteKind]:
    """Register ``kind(hidden, residual, tensors, settings)`` as the write kind ``name``."""

    def register(kind: WriteKind) -> WriteKind:
        if name in WRITE_KINDS and WRITE_KINDS[name] is not kind:
            raise ValueError(f"a write kind named {name!r} is already registered")
        WRITE_KINDS[name] = kind
        return kind

    return register


def write_spec(terms: Sequence[tuple[str, int, str]]) -> str:
    """The op's ``spec`` of ``terms``, in the order they apply: ``(kind, how many of the op's
    tensors it takes, its settings)`` each (settings hold no ``;``)."""
    for kind, _, settings in terms:
        if ";" in settings or ":" in kind:
            raise ValueError(f"write term {kind!r} settings {settings!r}: no ';' or ':'")
    return ";".join(f"{kind}:{count}:{settings}" for kind, count, settings in terms)


def read_spec(spec: str) -> list[tuple[str, int, str]]:
    """:func:`write_spec`'s terms."""
    terms = []
    for part in spec.split(";") if spec else ():
        kind, count, settings = part.split(":", 2)
        terms.append((kind, int(count), settings))
    return terms


@torch.library.custom_op(f"{OP_NAMESPACE}::write", mutates_args=("hidden",))
def write(
    hidden: torch.Tensor, residual: torch.Tensor | None, tensors: list[torch.Tensor], spec: str
) -> None:
    """Apply the terms ``spec`` names to the step's rows ``hidden`` (``[tokens, hidden]``;
    ``residual``: the deferred residual of vLLM layers that return ``(hidden, residual)``, or
    None), in order: each its own slice of ``tensors``."""
    at = 0
    for kind, count, settings in read_spec(spec):
        try:
            apply = WRITE_KINDS[kind]
        except KeyError:
            raise ValueError(
                f"probehook::write: no write kind {kind!r} is registered in this process "
                f"(registered: {sorted(WRITE_KINDS)})"
            ) from None
        apply(hidden, residual, tensors[at : at + count], settings)
        at += count


@write.register_fake
def _(
    hidden: torch.Tensor, residual: torch.Tensor | None, tensors: list[torch.Tensor], spec: str
) -> None:
    return None
