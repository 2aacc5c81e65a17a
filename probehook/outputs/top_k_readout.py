"""A top-k readout as one entry of the readout table: an output processor that also says
which engine and request options ask for it, how its named instances are checked against the
model, and what the worker computes from a row. Register it as any output processor
(``OUTPUT_PROCESSORS.register(MyReadout)``, or the ``probehook.output_processors`` entry
point: every process of an engine must know it), and it flows with no other edit: the engine
option (``LLM(**{engine_option: {name: spec}})``, ``probehook serve --readout
SOURCE:NAME=SPEC``), the per-request option (``extra_args={"probehook": {request_option:
[names]}}``), the worker's generic bank (:class:`~probehook.worker.top_k_bank.TopKBank`:
each name on the rows of the requests that asked for it), the generic top-k rows
(:class:`~probehook.outputs.top_k.TopKRows`) on offline outputs, streams and server choices,
and the store's sparse top-k datasets.

No vLLM. The worker calls :meth:`TopKReadout.read`; everything else runs in the front end.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch

from probehook.errors import CaptureConfigError
from probehook.outputs.columns import named_axes, pack_columns, packed_width, pad_packed
from probehook.outputs.registry import OutputProcessor
from probehook.outputs.top_k import PACKED_INDEX_LIMIT, TopKRows, compact_top_k, json_top_k


class TopKReadout(OutputProcessor):
    """Base class of top-k readouts. Subclasses set ``name`` (the output processor's),
    ``source`` (the capture source, also the readout's key on the wire and in the store),
    ``request_attributes = ("prefill_<x>",)``, ``completion_attributes = ("<x>",)``,
    ``engine_option`` and ``request_option``, and implement :meth:`settings` and
    :meth:`read`."""

    engine_option: ClassVar[str] = ""
    """The engine keyword argument that names the readout's instances: ``{name: spec}``."""
    request_option: ClassVar[str] = ""
    """The per-request option that picks instances: a list of names, True (all) or False."""
    extra_engine_options: ClassVar[tuple[str, ...]] = ()
    """Further engine keyword arguments of the readout (a lens's ``lens_layers``), handed to
    :meth:`instances`."""
    extra_request_options: ClassVar[tuple[str, ...]] = ()
    """Further per-request options (a lens's ``lens_layers``), handed to :meth:`pick`."""
    top_k_option: ClassVar[str] = ""
    """The one name of k's engine and request options (``lens_top_k``, ``sae_top_k``,
    ``attention_top_k``); empty: ``<engine_option>_top_k`` and ``<request_option>_top_k``."""
    default_k: ClassVar[int] = 8
    """Entries kept per token (the engine's ``<engine_option>_top_k`` may change it)."""
    max_k: ClassVar[int] = 256
    row_type: ClassVar[type[TopKRows]] = TopKRows
    """The rows' class (a subclass names the columns for its readout)."""
    follows_last_prefill_token: ClassVar[bool] = False
    """Whether a request's ``last_prefill_token`` thins its prompt rows to the last one (as
    hidden rows), instead of every prompt token (as probe scores and SAE features)."""
    tensor_parallel: ClassVar[bool] = True
    """Whether it runs under tensor parallelism (rank 0 reads every row)."""
    entries_are_tokens: ClassVar[bool] = False
    """The entries' indices are token ids (a lens's): the server writes each one's text
    beside them (:meth:`add_token_text`)."""
    entries_are_positions: ClassVar[bool] = False
    """The entries' indices are positions in the request's sequence (attention's keys): the
    viewers offer to shade every token by the pointed token's entry for it."""
    reads_next_token: ClassVar[bool] = False
    """The worker reads a row together with the id of the token that came next (a lens's
    target log-prob): its rows complete after the step's sampling, and :meth:`read` gets
    ``next_tokens``."""
    scalar_series: ClassVar[tuple[str, str] | None] = None
    """How viewers show the per-token scalar column as a colour series: ``(label, scale)``,
    the scale one of the viewer's (``"probability"``, ``"logprob"``, ``"activation"``); a
    lens's target log-prob is ``("target", "logprob")``. None: not shown as a series."""
    column_series: ClassVar[Mapping[str, str]] = {}
    """Further per-token columns of the row type (``extra_columns`` without axes) viewers
    show as colour series, by column name: the scale (``{"mean": "activation"}``)."""
    # ``monitor`` and ``flags_attribute`` (OutputProcessor's): its monitors' class, a
    # TopKMonitor subclass whose source is this readout's, and where their flags go; each
    # monitor is checked against the engine by :meth:`check_monitor`.

    site: ClassVar[str] = "resid_post"
    """Where its rows are read: ``"resid_post"`` (the stream after each instance's layer) or
    ``"attn_q"`` (the post-RoPE query at the layer's attention op: ``[heads x head size]``
    rows, tapped only for readouts that ask)."""
    reads_step: ClassVar[bool] = False
    """Its bank reads each row's request and position and what the adapter hands over
    (``StepContext.parts``): the recorder gives it the step's context and the rows' flat
    indices."""
    ranks: ClassVar[str] = "rank 0"
    """Which tensor-parallel ranks read it: ``"rank 0"`` (the rank that answers exports; the
    others hold the same rows), ``"every rank"`` (each rank reads in step, as a lens whose
    vocabulary is sharded, its partial readings merged by a collective; each rank also forces
    its monitors' stops alike, since every rank samples) or ``"rank 0, and the stops
    elsewhere"`` (the other ranks read only the rows a stop monitor watches, to force its stop
    themselves: SAE features)."""
    stored_prefix: ClassVar[str | None] = None
    """How a store names an instance's top-k datasets: this prefix and the instance's name;
    None: ``"<source>:"`` (``"lens:j@4"``). SAE features, the store's first top-k readout,
    are stored by their own names (``""``)."""
    instance_error: ClassVar[type[Exception]] = CaptureConfigError
    """The error a bad instance, k or pick raises (SAEs: ``SAEError``)."""
    instance_noun: ClassVar[str] = ""
    """What an instance is called in messages (default: the readout's name)."""
    reads_head: ClassVar[bool] = False
    """Its bank reads the model's final norm and unembedding (``ModelParts.head``, a lens);
    other banks get the model's device alone (nothing of a head is read at load for them)."""
    worker_bank: ClassVar[str] = "probehook.worker.top_k_bank:generic_bank"
    """The worker's factory of its bank, ``"module:function"`` called at load as
    ``function(readout, instances, k, model)`` (``model``: the parts of the model it may need,
    ``ModelParts``: head, norms, vocabulary shard); the default reads each instance with
    :meth:`read` on the rows of the requests that asked for it."""
    view_name: ClassVar[str] = ""
    """Its name in viewers (series ``"<view name> <instance>"``, the live page's choices);
    default: :attr:`name`."""
    cli_flag: ClassVar[str] = ""
    """``probehook serve``'s flag naming instances, ``--<cli_flag> NAME=SPEC`` (repeatable);
    default: the engine option's name with dashes (``--norms``). Its other engine options
    get flags of their own names with dashes (``--lens-layers``, ``--lens-top-k``)."""
    cli_named: ClassVar[bool] = True
    """Its instances' flag takes ``NAME=SPEC`` (repeatable); False: one value, read by
    :meth:`cli_value` (attention's ``--attention-layers 2,5``)."""
    cli_help: ClassVar[Mapping[str, str]] = {}
    """Each engine option's flag help, by option name (the instances', the k's, the extras')."""
    cli_choices: ClassVar[Mapping[str, tuple[str, ...]]] = {}
    """The values a flag takes, by option name, where they are few (a dtype)."""
    cli_switches: ClassVar[tuple[str, ...]] = ()
    """Engine options whose flags take no value (``--sae-clamping``: True when given)."""

    def cli_value(self, option: str, text: str) -> Any:
        """An engine option's value from its flag's text (the instances' specs stay text: their
        option checks them). Default: the k as an int, other options as JSON where they parse
        (``3``, ``[1, 2]``), else as text."""
        if option in self.cli_switches:
            return True
        if option == self.k_option:
            return int(text)
        try:
            return json.loads(text)
        except ValueError:
            return text

    def check_monitor(self, monitor: Any, k: int, vocab_size: int | None) -> None:
        """Refuse a monitor of this readout the engine cannot watch exactly (a clear
        :class:`~probehook.errors.CaptureConfigError`)."""
        if self.flags_attribute is None:
            raise CaptureConfigError(f"the {self.name} readout has no monitors.")

    def check_entry(self, monitor: Any, settings: Mapping[str, Any]) -> None:
        """Refuse a monitor of an entry instance ``settings`` cannot hold (a feature past an
        SAE's width). Default: any entry."""

    def named_specs(self, value: Any) -> dict[str, Any]:
        """The engine option's value as ``{name: spec}``, checked as the user gave it (before
        the model is known; an SAE's folder is read for its config here). Default: a
        non-empty dict."""
        if not isinstance(value, Mapping) or not value:
            raise self.instance_error(
                f"{self.engine_option}={value!r} is not valid: pass a non-empty dict of names "
                f"and {self.name} specs."
            )
        return dict(value)

    def worker_bytes(self, specs: Mapping[str, Any]) -> int:
        """What the instances will hold in each worker's memory (checked against the
        machine's before the engine starts). Default: nothing worth counting."""
        return 0

    def stored_name(self, instance: str) -> str:
        """An instance's name in a store (:attr:`stored_prefix`)."""
        prefix = f"{self.source}:" if self.stored_prefix is None else self.stored_prefix
        return prefix + instance

    def describe_instance(self, name: str, settings: Mapping[str, Any], k: int) -> dict[str, Any]:
        """What a store's run records of an instance, under its stored name: the readout, the
        index bound (``d_sae``), k, layer and settings."""
        return {
            "source": self.source,
            "readout": name,
            "d_sae": int(self.index_bound(settings)),
            "k": k,
            "layer": int(settings["layer"]),
            "settings": dict(settings),
        }

    @property
    def engine_options(self) -> tuple[str, ...]:
        """Its engine keyword arguments: its instances, its k, its further ones (none without
        an engine option)."""
        if not self.engine_option:
            return ()
        return (self.engine_option, self.k_option, *self.extra_engine_options)

    @property
    def request_options(self) -> tuple[str, ...]:
        """The request options that ask it: its picking option first, then its k, then its
        further ones."""
        return (self.request_option, self.request_k_option, *self.extra_request_options)

    @property
    def display_name(self) -> str:
        """:attr:`view_name`, or :attr:`name`."""
        return self.view_name or self.name

    @property
    def k_option(self) -> str:
        """The engine keyword argument for k: :attr:`top_k_option`, else
        ``<engine_option>_top_k``."""
        return self.top_k_option or f"{self.engine_option}_top_k"

    @property
    def request_k_option(self) -> str:
        """The per-request option for k (at most the engine's: the first k of its rows):
        :attr:`top_k_option`, else ``<request_option>_top_k``."""
        return self.top_k_option or f"{self.request_option}_top_k"

    def instances(
        self,
        specs: Mapping[str, Any],
        extras: Mapping[str, Any],
        *,
        num_layers: int,
        hidden_size: int,
        model_name: str | None = None,
    ) -> dict[str, dict]:
        """The settings of every instance, by instance name, from the engine option's
        ``{name: spec}`` and the readout's :attr:`extra_engine_options` (``extras``). Default:
        one instance per name (:meth:`settings`)."""
        return {
            str(name): self.settings(str(name), spec, num_layers=num_layers,
                                     hidden_size=hidden_size)
            for name, spec in specs.items()
        }  # fmt: skip

    def pickable(self, instances: Mapping[str, Mapping[str, Any]]) -> list[str]:
        """The names a request picks from with :attr:`request_option` (default: the
        instances')."""
        return list(instances)

    def narrow(
        self,
        names: list[str],
        extras: Mapping[str, Any],
        instances: Mapping[str, Mapping[str, Any]],
    ) -> list[str]:
        """The instances a request gets: from the names it picked and its values of
        :attr:`extra_request_options` (``extras``; checked here). Default: the names."""
        if extras:
            raise CaptureConfigError(
                f"the {self.name} readout takes no option(s) {sorted(extras)}."
            )
        return names

    def request_terms(
        self, names: list[str], extras: Mapping[str, Any], instances: Mapping[str, Mapping]
    ) -> Mapping[str, Any] | None:
        """What a request's further options ask of the rows of its instances ``names`` beyond
        picking them (attention's heads and spans), checked: JSON the worker's bank reads
        (``StepContext.request_terms``) and :meth:`view` shapes the rows by. Default: none."""
        return None

    def view(self, rows: TopKRows, settings: Mapping[str, Any], terms: Any) -> TopKRows:
        """An instance's rows as the worker read them (every entry of each named axis) ->
        the request's, by its :meth:`request_terms` (``terms``, None without any). Default:
        the rows."""
        return rows

    def present(self, rows: dict[str, TopKRows]) -> Any:
        """The value users see from the rows by instance name (default: that dict)."""
        return rows

    def flat(self, value: Any) -> dict[str, TopKRows]:
        """The inverse of :meth:`present`: rows by instance name (what the store keeps)."""
        return value

    def settings(self, name: str, spec: Any, *, num_layers: int, hidden_size: int) -> dict:
        """The JSON-able settings of instance ``name`` the worker reads (``"layer"``: the
        decoder layer whose rows it reads), checked against the model; a clear
        :class:`~probehook.errors.CaptureConfigError` otherwise."""
        raise NotImplementedError

    def index_bound(self, settings: Mapping[str, Any]) -> int:
        """How many distinct indices an instance's rows can hold (a vocabulary's size, an
        SAE's width): the store keeps indices in the smallest unsigned type that holds them.
        Default: what the worker's packed rows carry exactly
        (:data:`~probehook.outputs.top_k.PACKED_INDEX_LIMIT`); a larger bound is refused at
        construction (a token readout's is its model's vocabulary)."""
        return PACKED_INDEX_LIMIT

    def axis_sizes(self, settings: Mapping[str, Any], k: int) -> dict[str, int]:
        """The sizes of an instance's column axes: ``"k"`` (the engine's) and each named axis
        of the row type's schema, from the instance's settings (``settings["heads"]``)."""
        sizes = {"k": int(k)}
        for axis in named_axes(self.row_type.schema()):
            sizes[axis] = int(settings[axis])
        return sizes

    def packed_width(self, settings: Mapping[str, Any], k: int) -> int:
        """An instance's packed row width (its column schema's at the engine's k)."""
        return packed_width(self.row_type.schema(), self.axis_sizes(settings, k))

    def entries(self, settings: Mapping[str, Any], k: int) -> int:
        """How many entries (indices, and as many values) an instance's row holds at ``k``:
        ``k`` times its lead axes' sizes."""
        return self.row_type.schema()[0].width(self.axis_sizes(settings, k))

    def pad_packed(self, out: torch.Tensor, settings: Mapping[str, Any], k: int) -> None:
        """Packed rows ``out`` of an instance as no reading (indices -1, the rest 0)."""
        schema = self.row_type.schema()
        pad_packed(schema, out, self.axis_sizes(settings, k), schema[0].name)

    def pack(
        self,
        indices: torch.Tensor,
        values: torch.Tensor,
        scalar: torch.Tensor,
        **extra: torch.Tensor,
    ) -> torch.Tensor:
        """An instance's readings as packed rows: the row type's columns in schema order
        (:func:`pack` for this readout's schema)."""
        return pack(indices, values, scalar, row_type=self.row_type, **extra)

    def read(self, rows: torch.Tensor, settings: Mapping[str, Any], k: int) -> torch.Tensor:
        """In the worker: ``rows`` ``[n, hidden]`` of the instance's layer -> packed float32
        ``[n, width]`` in the row type's column schema, on the rows' device: by default
        ``[n, 2k + 1]`` (k indices, -1 padding; k values, 0 padding; l0): build it with
        :meth:`pack` (integers travel as int32 bits). A readout that
        :attr:`reads_next_token` takes ``next_tokens`` too: int64 ``[n]``, each row's next
        token id (-1 where none came: a capture-only engine's last prompt row, a request that
        ended), on the rows' device."""
        raise NotImplementedError

    # -- the output processor's part: generic over top-k rows --------------------------

    def merge(self, pieces: list[Any]) -> Any:
        flats = [self.flat(piece) for piece in pieces]
        names = list(dict.fromkeys(name for piece in flats for name in piece))
        return self.present(
            {name: self.row_type.cat([p[name] for p in flats if name in p]) for name in names}
        )

    def to_response(self, value: Any) -> dict[str, Any]:
        return {name: json_top_k(rows) for name, rows in self.flat(value).items()}

    def to_compact(self, value: Any) -> dict[str, Any]:
        return compact_top_k(self.flat(value))

    def from_response(self, response: Any) -> Any:
        return self.present(
            {name: self.row_type.from_columns(c) for name, c in self.served(response).items()}
        )

    def served_path(self, instance: str) -> list[str]:
        """Where an instance's columns sit in the served field (:meth:`written`'s keys)."""
        return [instance]

    def served(self, response: dict[str, Any]) -> dict[str, Any]:
        """Each instance's columns in a served response, by instance name (the inverse of
        :meth:`written`'s nesting)."""
        return dict(response)

    def written(self, response: dict[str, Any], name: str) -> dict[str, Any]:
        """Instance ``name``'s columns in :meth:`to_response`'s or :meth:`to_compact`'s
        form (a subclass that nests them finds them)."""
        return response[name]

    def add_token_text(
        self, response: dict[str, Any], value: Any, token_text: Callable[[int], str]
    ) -> None:
        """Write ``"tokens"``, each entry's text (``token_text`` of its id; padding: null),
        beside the ids of every instance in ``response`` (of :attr:`entries_are_tokens`
        readouts: the server does)."""
        for name, rows in self.flat(value).items():
            self.written(response, name)["tokens"] = [
                [token_text(i) if i >= 0 else None for i in ids] for ids in rows.indices.tolist()
            ]


def pack(
    indices: torch.Tensor,
    values: torch.Tensor,
    l0: torch.Tensor,
    row_type: type[TopKRows] = TopKRows,
    **extra: torch.Tensor,
) -> torch.Tensor:
    """``[n, *lead, k]`` indices and values, ``[n, *lead]`` scalars and ``row_type``'s further
    columns by name as the worker's packed float32 rows (what :meth:`TopKReadout.read`
    returns; by default ``[n, 2k + 1]``): every column flattened in schema order, integer
    columns as int32 bits (:func:`~probehook.outputs.top_k.carry_indices`)."""
    schema = row_type.schema()
    missing = [c.name for c in schema[3:] if c.name not in extra]
    if missing or len(extra) != len(schema) - 3:
        raise ValueError(
            f"{row_type.__name__} packs columns {[c.name for c in schema]}; given the three "
            f"and {sorted(extra)}"
        )
    return pack_columns(schema, [indices, values, l0, *(extra[c.name] for c in schema[3:])])


def top_k_readouts(processors: Any) -> dict[str, TopKReadout]:
    """The registered top-k readouts by source (``processors``: ``OUTPUT_PROCESSORS``)."""
    return {p.source: p for p in processors if isinstance(p, TopKReadout) and p.source}
