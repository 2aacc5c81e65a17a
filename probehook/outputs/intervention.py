"""An intervention as one entry of the write table: an output processor that also says which
engine option installs it (its instances: one write term each, at a site of a layer), which
request option asks for it (terms checked in the front end, hashed into the prefix-cache
salt), which worker kind applies it and how the worker writes each request's row of its
tables. Register it as any output processor (``OUTPUT_PROCESSORS.register(MyIntervention)``,
or the ``probehook.output_processors`` entry point: every process of an engine must know it),
and it flows with no other edit: the engine option (``LLM(**{engine_option: value})``,
``probehook serve --<cli flag>``), the request option (``extra_args={"probehook":
{request_option: value}}``, served too), the worker's write op at its sites, and what it
applied on each completion's ``steering`` (``steering[request_option]``: offline, streamed,
served, stored, marked in the viewer).

SAE clamping (``probehook.saes.clamp``) is such an entry. No vLLM. The worker calls the
factory :attr:`Intervention.worker_writer` names; everything else runs in the front end.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from probehook.errors import CaptureConfigError
from probehook.outputs.registry import OutputProcessor

SITES = ("resid_post", "resid_pre")
"""Where a write term applies on a decoder layer: its output (the residual stream after it,
where the taps read) or its input (the stream before it; layer 0's is the embeddings)."""

STEERING_KEYS = ("vectors", "phase", "gate", "start", "ops")
"""A completion's ``steering`` keys that are steering's own; each other key is a write-table
entry's request option, holding what it applied (``Intervention.applied``)."""


@dataclass(frozen=True)
class EngineFacts:
    """What an intervention's instances are checked against (front end, before start-up)."""

    num_layers: int
    hidden_size: int
    readouts: Mapping[str, Any] = field(default_factory=dict)
    """The engine's top-k readouts by source (``ReadoutSet``: their checked instances); an
    intervention that writes with a readout's weights (SAE clamps) reads its instances here."""


class Intervention(OutputProcessor):
    """Base class of write-table entries. Subclasses set ``name``, ``engine_option``,
    ``request_option``, ``kind`` (the worker's write kind, ``probehook.worker.write_op``) and
    ``worker_writer``, and implement :meth:`instances` and :meth:`check_terms`.

    Instances are ``{name: settings}``, each settings a JSON object holding at least
    ``"layer"`` and ``"site"`` (one of :data:`SITES`). A request's terms are
    ``{instance: value}`` (JSON), the form :meth:`check_terms` returns and the worker's
    writers read."""

    engine_option: ClassVar[str] = ""
    """The engine keyword argument that installs it (its value: :meth:`instances`)."""
    request_option: ClassVar[str] = ""
    """The per-request option that asks for it (its value: :meth:`check_terms`); also its key
    in each completion's ``steering``."""
    kind: ClassVar[str] = ""
    """The write kind its terms apply (registered with ``write_kind`` in the worker)."""
    worker_writer: ClassVar[str] = ""
    """The worker's factory of its instances' writers, ``"module:function"`` called at load as
    ``function(intervention, instances, context)`` (``context``:
    ``probehook.worker.write_table.WriterContext``), returning ``{instance: InstanceWriter}``."""
    cli_flag: ClassVar[str] = ""
    """``probehook serve``'s flag of the engine option; default: its name with dashes."""
    cli_help: ClassVar[str] = ""
    cli_switch: ClassVar[bool] = False
    """The flag takes no value (True when given), as ``--sae-clamping``."""
    instance_error: ClassVar[type[Exception]] = CaptureConfigError

    @property
    def engine_options(self) -> tuple[str, ...]:
        return (self.engine_option,)

    def instances(self, value: Any, engine: EngineFacts) -> dict[str, dict[str, Any]]:
        """The engine option's value as checked instances (empty: nothing installed)."""
        raise NotImplementedError

    def check_terms(self, value: Any, instances: Mapping[str, Mapping[str, Any]]) -> dict:
        """A request option's value as ``{instance: terms}`` (JSON, canonical: equal requests
        give equal terms), or a clear ``instance_error`` naming the value and the fix."""
        raise NotImplementedError

    def salt(self, terms: Mapping[str, Any]) -> str:
        """The prefix-cache salt of a request's terms: requests with different terms never
        share cached blocks. Default: a digest of their canonical JSON."""
        text = json.dumps([self.name, terms], sort_keys=True, separators=(",", ":"))
        return f"{self.request_option}-" + hashlib.sha256(text.encode()).hexdigest()[:32]

    def applied(self, terms: Mapping[str, Any]) -> Any:
        """What a completion's ``steering[request_option]`` records of the terms applied."""
        return dict(terms)

    def mark(self, applied: Any) -> str:
        """The viewer's words for what was applied (every token of the request)."""
        return f"{self.request_option} {json.dumps(applied, sort_keys=True)} on every token"

    def cli_value(self, text: str) -> Any:
        """The engine option's value from its flag's text: True for a switch, else JSON where
        it parses (``[1, 2]``), else the text."""
        if self.cli_switch:
            return True
        try:
            return json.loads(text)
        except ValueError:
            return text


def check_site(
    owner: Intervention, instance: str, settings: Mapping[str, Any], layers: int
) -> None:
    """Refuse an instance whose site or layer the engine cannot write at."""
    site, layer = settings.get("site"), settings.get("layer")
    if site not in SITES:
        raise owner.instance_error(
            f"{owner.engine_option}: instance {instance!r} writes at site {site!r}; the sites "
            f"are {list(SITES)}."
        )
    if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < layers:
        raise owner.instance_error(
            f"{owner.engine_option}: instance {instance!r} writes at layer {layer!r}; the model "
            f"has layers 0..{layers - 1}."
        )


def interventions(processors: Any) -> dict[str, Intervention]:
    """The registered interventions by request option."""
    return {p.request_option: p for p in processors if isinstance(p, Intervention)}
