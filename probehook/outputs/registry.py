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
        self._processors[name] = instance
        return processor

    def unregister(self, name: str) -> OutputProcessor:
        """Remove a processor (to replace it, say, when a notebook cell runs again); returns
        it. An unknown name is an error listing the known ones."""
        processor = self[name]
        del self._processors[name]
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
