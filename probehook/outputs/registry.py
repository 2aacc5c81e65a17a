"""The output-processor registry: one place that decides what a request returns besides text.

An output processor owns some attributes of vLLM's outputs (on the request output, on each
completion, or both) and says how their values are written into an HTTP response and how the
pieces a stream delivers join up. probehook's own captures (hidden states, probe scores, probe
flags) are processors registered here like any third party's, and the offline ``LLM``, the
streaming ``AsyncLLM`` and the server read and write those attributes through the registry.

Register a processor by name (``OUTPUT_PROCESSORS.register(processor)``, or as a class
decorator), attach one to a model class (``@OUTPUT_PROCESSORS.for_model("name")``), or ship one
in a package through the entry-point group ``probehook.output_processors`` (each entry point
is a zero-argument callable returning a processor).

This module knows nothing about vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, ClassVar, TypeVar

from probehook.errors import ProbehookError

ENTRY_POINT_GROUP = "probehook.output_processors"
MODEL_ATTRIBUTE = "probehook_output_processor"
"""The attribute ``for_model`` sets on a model class: the name of its output processor."""


class OutputProcessorError(ProbehookError, ValueError):
    """A bad registration, or a lookup of a name nobody registered."""


class OutputProcessor:
    """Base class of output processors. Subclasses set ``name`` and the attributes they own,
    and override what differs from the defaults (values are returned as they are).

    - ``request_attributes`` / ``completion_attributes``: attributes this processor owns on
      a ``RequestOutput`` and on each of its ``CompletionOutput``s; every output gets them,
      empty (``empty()``) until filled.
    - ``fill(output)``: derive this processor's values on a finished or streamed output from
      what it carries (its rows, text, tokens); called on every output probehook hands out,
      offline, streamed and served, after capture attached the rows. Default: nothing (the
      values are set elsewhere, as the built-in processors' are by capture).
    - ``merge(pieces)``: one value from the pieces of consecutive stream outputs, in order.
    - ``to_response(value)``: the JSON-ready form for an HTTP response; ``from_response``
      its inverse (a client's view of a saved response).
    """

    name: ClassVar[str] = ""
    request_attributes: ClassVar[tuple[str, ...]] = ()
    completion_attributes: ClassVar[tuple[str, ...]] = ()
    source: ClassVar[str | None] = None
    """The worker capture source (``"hidden"`` rows or probe ``"scores"``) whose values fill
    this processor's attributes: its first request attribute gets the prompt's, its first
    completion attribute each completion's. None: filled by something else."""
    monitor: ClassVar[type | None] = None
    """The class of the monitors that watch its values (a
    :class:`~probehook.core.monitors.TopKMonitor` subclass: ``LensMonitor``); registering the
    processor registers it. None: nothing watches them."""
    flags_attribute: ClassVar[str | None] = None
    """The completion attribute its monitors' flags go to (``"lens_flags"``): registering the
    processor registers a :class:`MonitorFlags` processor owning it."""

    def derived(self) -> list[OutputProcessor]:
        """The processors registering this one registers too (its monitors' flags)."""
        return [MonitorFlags(self.flags_attribute)] if self.flags_attribute else []

    def empty(self) -> Any:
        return {}

    def fill(self, output: Any) -> None:
        return None

    def merge(self, pieces: list[Any]) -> Any:
        if len(pieces) != 1:
            raise NotImplementedError(f"output processor {self.name!r} cannot merge pieces")
        return pieces[0]

    def to_response(self, value: Any) -> Any:
        return value

    def from_response(self, response: Any) -> Any:
        """The inverse of :meth:`to_response` (and of a compact form): the value from a
        served response's field (JSON, as a client receives it). Default: as it is."""
        return response

    def __repr__(self) -> str:
        return f"<output processor {self.name!r}>"


class MonitorFlags(OutputProcessor):
    """The rows where a monitor of another processor's values crossed its threshold, by the
    monitor's key (``{"j@3:42": [0, 5]}``): one completion attribute, the watched processor's
    ``flags_attribute``, registered with it. A stream's pieces join by concatenation."""

    def __init__(self, attribute: str) -> None:
        self.name = attribute  # type: ignore[misc]
        self.completion_attributes = (attribute,)  # type: ignore[misc]

    def merge(self, pieces: list[dict[str, list[int]]]) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for piece in pieces:
            for key, rows in piece.items():
                out.setdefault(key, []).extend(rows)
        return out


class OnePassProcessor(OutputProcessor):
    """An output processor for a one-pass (pooling) model that also owns that model's input:
    one user input becomes several requests (patches of an image, say), and their outputs
    become one result. probehook runs it as vLLM's IO Processor plugin ``probehook``
    (``probehook.adapter.frontend.io_processor``); attach it to the model class with
    ``@OUTPUT_PROCESSORS.for_model(name)``.

    Every method runs in the front-end process. ``parse`` and ``split`` raise on bad input
    before any model work starts.
    """

    pooling_task: ClassVar[str] = "token_classify"
    """The pooling task each of the input's requests runs (vLLM's PoolingParams.task)."""

    def parse(self, data: Any, online: bool) -> Any:
        """Validate a user input (``online``: it came over HTTP); return what ``split`` and
        ``assemble`` need."""
        raise NotImplementedError

    def split(self, parsed: Any) -> list[dict[str, Any]]:
        """The prompts (``{"prompt_token_ids": [...]}``) the input runs as, in order."""
        raise NotImplementedError

    def assemble(self, parsed: Any, outputs: list[Any]) -> Any:
        """One result from the requests' pooled outputs (in ``split`` order). The result is
        what vLLM returns offline and, through ``to_response``, in the HTTP response."""
        raise NotImplementedError


P = TypeVar("P")


class OutputProcessorRegistry:
    """Output processors by name, and which model classes use which."""

    def __init__(self, entry_point_group: str | None = ENTRY_POINT_GROUP) -> None:
        self._processors: dict[str, OutputProcessor] = {}
        self._group = entry_point_group
        self._loaded = entry_point_group is None

    def register(self, processor: P) -> P:
        """Register a processor instance, or a processor class (instantiated with no
        arguments; usable as a class decorator). Returns its argument."""
        instance = processor() if isinstance(processor, type) else processor
        if not isinstance(instance, OutputProcessor):
            raise OutputProcessorError(
                f"{processor!r} is not an output processor: subclass "
                "probehook.outputs.OutputProcessor and set its name."
            )
        name = instance.name
        if not isinstance(name, str) or not name:
            raise OutputProcessorError(f"{processor!r} has no name; set `name = '...'`.")
        if name in self._processors:
            raise OutputProcessorError(
                f"An output processor named {name!r} is already registered "
                f"({self._processors[name]!r}); pick another name."
            )
        owned = {a: p for p in self._processors.values() for a in _attributes(p)}
        clash = sorted(set(_attributes(instance)) & set(owned))
        if clash:
            raise OutputProcessorError(
                f"Output processor {name!r} would own attribute(s) {clash}, already owned by "
                f"{[owned[a].name for a in clash]}."
            )
        derived = instance.derived()
        names = [d.name for d in derived]
        taken = [n for n in names if n in self._processors]
        if taken:
            raise OutputProcessorError(
                f"Output processor {name!r} would register {taken}, already registered."
            )
        if instance.monitor is not None:
            from probehook.core.monitors import top_k_monitor

            top_k_monitor(instance.monitor)  # type: ignore[arg-type]
        self._processors[name] = instance
        for made in derived:
            self._processors[made.name] = made
        return processor

    def unregister(self, name: str) -> OutputProcessor:
        """Remove a processor and those it registered (to replace it, say, when a notebook
        cell runs again); returns it. An unknown name is an error listing the known ones."""
        processor = self[name]
        del self._processors[name]
        for made in processor.derived():
            self._processors.pop(made.name, None)
        return processor

    def for_model(self, name: str) -> Callable[[type], type]:
        """Class decorator: ``model_cls`` returns its outputs through processor ``name``
        (checked when :meth:`for_model_class` looks it up, so order of import is free)."""

        def name_processor_of(model_cls: type) -> type:
            setattr(model_cls, MODEL_ATTRIBUTE, name)
            return model_cls

        return name_processor_of

    def for_model_class(self, model_cls: type) -> OutputProcessor | None:
        """The processor a model class was attached to with :meth:`for_model`, if any."""
        name = getattr(model_cls, MODEL_ATTRIBUTE, None)
        return None if name is None else self[name]

    def for_source(self, source: str) -> OutputProcessor:
        """The processor that captured values of ``source`` fill."""
        for processor in self:
            if processor.source == source:
                return processor
        raise OutputProcessorError(f"No output processor is filled by capture source {source!r}.")

    def __getitem__(self, name: str) -> OutputProcessor:
        self._load_entry_points()
        try:
            return self._processors[name]
        except KeyError:
            raise OutputProcessorError(
                f"No output processor named {name!r}; known: {sorted(self._processors)}. "
                f"Register it with OUTPUT_PROCESSORS.register(...) or the entry-point group "
                f"{ENTRY_POINT_GROUP!r}."
            ) from None

    def __contains__(self, name: object) -> bool:
        self._load_entry_points()
        return name in self._processors

    def __iter__(self) -> Iterator[OutputProcessor]:
        self._load_entry_points()
        return iter(list(self._processors.values()))

    def names(self) -> list[str]:
        self._load_entry_points()
        return list(self._processors)

    def _load_entry_points(self) -> None:
        """Register the group's processors, once; a broken one is an error that names it."""
        if self._loaded:
            return
        self._loaded = True
        from importlib.metadata import entry_points

        for entry in entry_points(group=self._group or ""):
            try:
                made = entry.load()()
            except Exception as e:
                raise OutputProcessorError(
                    f"Output processor entry point {entry.name!r} ({entry.value}) failed to "
                    f"load: {e}"
                ) from e
            self.register(made)


def _attributes(processor: OutputProcessor) -> tuple[str, ...]:
    return (*processor.request_attributes, *processor.completion_attributes)
