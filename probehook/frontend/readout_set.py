"""The front end's view of an engine's top-k readouts (each a registered
:class:`~probehook.outputs.top_k_readout.TopKReadout`): the instances checked against the
model at construction, the settings the workers' loader reads, each request's pick checked
before it reaches the engine, and the worker's packed rows turned into
:class:`~probehook.outputs.top_k.TopKRows`. No vLLM imports.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from probehook.core.named import select_names
from probehook.errors import CaptureConfigError
from probehook.outputs.top_k import check_packed_indices


@dataclass(frozen=True)
class RequestReadout:
    """The instances of one top-k readout a request gets, and the entries it keeps."""

    names: tuple[str, ...]
    k: int
    monitors: tuple[Any, ...] = ()
    """The monitors of its instances that watch the request (lens monitors)."""
    terms: Mapping[str, Any] | None = None
    """What its further options ask of the rows (``TopKReadout.request_terms``: JSON)."""

    @property
    def stops(self) -> bool:
        return any(m.action == "stop" for m in self.monitors)


class ReadoutSet:
    """One top-k readout's instances in an engine, by name, and its k."""

    def __init__(
        self,
        readout: Any,
        specs: Mapping[str, Any],
        k: int | None,
        *,
        num_layers: int,
        hidden_size: int,
        extras: Mapping[str, Any] | None = None,
        model_name: str | None = None,
        monitors: Sequence[Any] = (),
        vocab_size: int | None = None,
    ) -> None:
        self.readout = readout
        self.source: str = readout.source
        specs = readout.named_specs(specs)
        k = readout.default_k if k is None else k
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= readout.max_k:
            raise readout.instance_error(
                f"{readout.k_option}={k!r} is not valid: pass an int in 1..{readout.max_k} "
                "(entries kept per token)."
            )
        self.k = k
        self.instances = readout.instances(
            specs, dict(extras or {}), num_layers=num_layers, hidden_size=hidden_size,
            model_name=model_name,
        )  # fmt: skip
        for name, settings in self.instances.items():
            if readout.entries_are_tokens:  # token ids: bounded by the model's vocabulary
                bound = vocab_size if vocab_size is not None else 0
            else:
                bound = readout.index_bound(settings)
            check_packed_indices(bound, f"{readout.name} {name!r}")
        self.layers = tuple(sorted({int(s["layer"]) for s in self.instances.values()}))
        self.vocab_size = vocab_size
        self.monitors = tuple(self.check_monitor(m) for m in monitors)
        """The engine's monitors of this readout (each request of its instances gets them,
        unless it passes monitors of its own)."""

    def check_monitor(self, monitor: Any) -> Any:
        """A monitor of this readout checked against the engine's instances and k."""
        if monitor.instance not in self.instances:
            raise self.readout.instance_error(
                f"{type(monitor).__name__} watches {monitor.instance!r}, which this engine "
                f"does not read; its {self.noun}s are {list(self.instances)}."
            )
        self.readout.check_monitor(monitor, self.k, self.vocab_size)
        self.readout.check_entry(monitor, self.instances[monitor.instance])
        return monitor

    @property
    def noun(self) -> str:
        """What an instance is called in messages (``"SAE"``, ``"lens instance"``)."""
        return self.readout.instance_noun or f"{self.readout.name} instance"

    def slot(self, instance: str) -> int:
        """An instance's slot in the workers' bank (their order of :attr:`instances`)."""
        return list(self.instances).index(instance)

    @property
    def request_options(self) -> tuple[str, ...]:
        """The request options that ask it: its picking option first, then its k, then its
        further ones."""
        return self.readout.request_options

    def describe(self) -> dict[str, Any]:
        """What a request may ask of this readout (the server's ``GET /v1/probehook``), and
        how its served field reads (for clients such as the live viewer): the choice's
        attribute, the columns' names, where each instance sits, whether entries are tokens
        and the scalar's series."""
        readout = self.readout
        return {
            "options": list(self.request_options),
            "names": readout.pickable(self.instances),
            "layers": list(self.layers),
            "k": self.k,
            "name": readout.display_name,
            "attribute": readout.completion_attributes[0],
            "columns": list(readout.row_type.column_names),
            "served": {i: readout.served_path(i) for i in self.instances},
            "tokens": readout.entries_are_tokens,
            "positions": readout.entries_are_positions,
            "series": list(readout.scalar_series) if readout.scalar_series else None,
            "column_series": dict(readout.column_series),
            "flags": readout.flags_attribute,
        }

    def loader_settings(self) -> dict[str, Any]:
        """What the workers' loader builds the readout's bank from."""
        return {"k": self.k, "instances": self.instances}

    def for_request(
        self,
        picked: Any,
        extras: Mapping[str, Any] | None = None,
        monitors: Sequence[Any] | None = None,
    ) -> RequestReadout | None:
        """A request's pick (None or True: every instance; False or []: none; names), its
        values of the readout's further request options (``extras``) and its own monitors
        (None: the engine's of the instances it reads; a list, of any kind: they replace the
        engine's, and those of this readout must watch instances it reads)."""
        readout = self.readout
        extras = dict(extras or {})
        k = self._request_k(extras.pop(readout.request_k_option, None))
        names = select_names(picked, readout.pickable(self.instances), readout.request_option,
                             self.noun, readout.instance_error)  # fmt: skip
        names = readout.narrow(names, extras, self.instances)  # checks extras
        terms = readout.request_terms(list(names), extras, self.instances)
        if monitors is None:
            mine = tuple(m for m in self.monitors if m.instance in names)
        else:
            mine = tuple(
                self.check_monitor(m) for m in monitors if getattr(m, "source", None) == self.source
            )
            off = sorted({m.instance for m in mine} - set(names))
            if off:
                raise readout.instance_error(
                    f"This request's monitors watch {off}, which the request does not read "
                    f"({readout.request_option}: {list(names)}); ask for them too."
                )
        return RequestReadout(tuple(names), k, mine, terms) if names else None

    def _request_k(self, asked: Any) -> int:
        """A request's k of this readout: the first ``asked`` entries of the engine's ``k``
        (None: all of them)."""
        if asked is None:
            return self.k
        if isinstance(asked, bool) or not isinstance(asked, int) or not 1 <= asked <= self.k:
            raise self.readout.instance_error(
                f"probehook option {self.readout.request_k_option}={asked!r} is not valid: "
                f"pass an int in 1..{self.k} (the engine's {self.readout.k_option}; a request "
                "keeps the first entries of the engine's)."
            )
        return asked

    def values(self, packed: Any, request: RequestReadout) -> Any:
        """``[len(request.names), n, width]`` packed rows -> the readout's value (rows per
        instance, as the readout presents them)."""
        unpack = self.readout.row_type.unpack
        return self.readout.present(
            {
                name: self.view(name, unpack(rows, request.k, self.sizes(name)), request)
                for name, rows in zip(request.names, packed, strict=True)
            }
        )

    def view(self, name: str, rows: Any, request: RequestReadout) -> Any:
        """Instance ``name``'s rows at the request's k as the worker read them -> the
        request's (``TopKReadout.view``)."""
        return self.readout.view(rows.top(request.k), self.instances[name], request.terms)

    def sizes(self, name: str) -> dict[str, int]:
        """Instance ``name``'s column axis sizes at the engine's k (``TopKReadout.
        axis_sizes``)."""
        return self.readout.axis_sizes(self.instances[name], self.k)

    def empty(self, request: RequestReadout) -> Any:
        empty = self.readout.row_type.empty
        return self.readout.present(
            {
                name: self.view(name, empty(request.k, self.sizes(name)), request)
                for name in request.names
            }
        )

    def store_description(self) -> dict[str, dict[str, Any]]:
        """What a store's run records of each instance, under its stored name
        (``TopKReadout.stored_name``: ``"lens:j@4"``; an SAE's own name)."""
        readout = self.readout
        return {
            readout.stored_name(name): readout.describe_instance(name, settings, self.k)
            for name, settings in self.instances.items()
        }


def without_unread(options: Any, sources: Collection[str]) -> Any:
    """A request's options without those of registered top-k readouts the engine does not
    read (``sources``: the ones it does) where they ask for nothing (a picking option set to
    False, as a client that sends it to every server does); one that asks for something is refused,
    naming the engine option that would read it. Other options are
    :meth:`RequestOptions.from_user`'s to check."""
    if not isinstance(options, Mapping):
        return options
    from probehook.outputs import registered_readouts

    dropped = []
    for source, readout in registered_readouts().items():
        if source in sources:
            continue
        for option in (o for o in readout.request_options if o in options):
            if options[option] in (None, False, [], ()):
                dropped.append(option)
                continue
            raise CaptureConfigError(
                f"This request sets {option}, but the engine reads no {readout.name}; build "
                f"it with {readout.engine_option}={{...}}."
            )
    return {k: v for k, v in options.items() if k not in dropped} if dropped else options
