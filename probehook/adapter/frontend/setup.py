"""Building a capturing engine, shared by every front end (``LLM`` and ``AsyncLLM``).

:func:`prepare` runs before vLLM starts anything: it checks the arguments, resolves the model's
layers and probes, and returns the engine arguments that switch capture on. After the engine is
up and its workers answered ``probehook_start_recording``, :func:`start` builds the front end's
:class:`~probehook.frontend.session.CaptureSession` and opens the store.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from probehook._version import __version__ as probehook_version
from probehook.adapter.frontend import engine_config, outputs
from probehook.capture_config import CaptureConfig, resolve_layers
from probehook.core.bank_file import WorkerBanks
from probehook.core.monitors import TopKMonitor
from probehook.core.steering_wire import DEFAULT_CAPACITY, vector_rows
from probehook.errors import CaptureConfigError, CaptureError
from probehook.frontend.capture_request import (
    CaptureRequest,
)
from probehook.frontend.probe_set import ProbeSet
from probehook.frontend.readout_set import ReadoutSet
from probehook.frontend.session import CaptureSession, Rpc
from probehook.frontend.steering_set import SteeringSet
from probehook.frontend.write_set import WriteSet
from probehook.outputs import OUTPUT_PROCESSORS
from probehook.outputs.intervention import EngineFacts, check_site, interventions
from probehook.outputs.top_k import RUN_TOP_K_KEY
from probehook.outputs.top_k_readout import top_k_readouts
from probehook.store import ActivationStore
from probehook.store.fingerprint import legacy_fingerprint, model_fingerprint
from probehook.store.format import ROOT_LANE, check_lane_name
from probehook.store.lock import WriterLock


@dataclass
class CaptureSetup:
    """Everything :func:`prepare` resolved, for :func:`start`."""

    config: CaptureConfig
    probes: ProbeSet | None
    engine_kwargs: dict[str, Any]
    fingerprint: dict[str, Any]
    legacy_fingerprint: Any
    limit: int
    store: str | None
    store_options: dict[str, Any]
    steering: SteeringSet | None = None

    banks: str | None = None
    """The probes and first steering vectors the workers' loader reads at model load
    (:meth:`WorkerBanks.encode`; inline in the engine's config: no file)."""
    readouts: dict[str, ReadoutSet] = dataclasses.field(default_factory=dict)
    """The engine's top-k readouts, by source."""
    writes: dict[str, WriteSet] = dataclasses.field(default_factory=dict)
    """The engine's write-table entries, by request option."""

    def recording_args(self) -> tuple[int]:
        """Arguments of the workers' ``probehook_start_recording`` (the banks came at load)."""
        return (self.limit,)


def prepare(
    model: str,
    kwargs: dict[str, Any],
    request: CaptureRequest,
    resolve: Callable[[str, dict[str, Any]], Any],
) -> CaptureSetup | None:
    """Check the capture arguments and build the engine arguments; None when the request
    captures nothing (the front end is then plain vLLM). Call inside
    ``engine_config.capture_engine_start()``, and start the engine inside the same block.

    Args:
        resolve: builds the ``VllmConfig`` that the engine will run with from ``(model,
            kwargs)``, without starting it.
    """
    if not request.captures:
        return None
    probes = request.probes
    limit = _check_limit(request.max_request_capture_bytes)
    # The user's load format: capture_engine_kwargs swaps in probehook's wrapper.
    load_format = kwargs.get("load_format") or "auto"
    if request.capture_only:
        kwargs = capture_only_kwargs(kwargs)
    resolved = resolve(model, kwargs)
    num_layers = engine_config.check_engine(resolved)
    hf_config = resolved.model_config.hf_config
    fingerprint = model_fingerprint(hf_config, resolved.model_config.model, load_format)
    probe_set = None
    if probes is not None:
        probe_set = ProbeSet(
            probes,
            [m for m in request.monitors or () if not isinstance(m, TopKMonitor)],
            num_layers=num_layers,
            hidden_size=resolved.model_config.get_hidden_size(),
            model_fingerprint=fingerprint["fingerprint"],
        )
    readouts = _readout_sets(
        request, num_layers, resolved.model_config.get_hidden_size(),
        model_name=resolved.model_config.model,
        vocab_size=resolved.model_config.get_vocab_size(),
    )  # fmt: skip
    pooling = engine_config.is_pooling(resolved)
    if pooling:
        _check_pooling(request, resolved.model_config.architectures)
    converted = getattr(resolved.model_config, "convert_type", "none") not in (None, "none")
    _check_readouts(readouts, pooling, converted, resolved.parallel_config.tensor_parallel_size)
    writes = _write_sets(
        request.writes or {},
        EngineFacts(num_layers, resolved.model_config.get_hidden_size(), readouts),
    )
    steering = None
    if request.steers:
        steer_layers = {layer for v in request.steering.values() for layer in v.layers}
        if request.steering_layers is not None:
            steer_layers |= set(resolve_layers(request.steering_layers, num_layers))
        steering = SteeringSet(
            {},
            layers=sorted(steer_layers),
            capacity=request.steering_capacity,
            num_layers=num_layers,
            hidden_size=resolved.model_config.get_hidden_size(),
            model_fingerprint=fingerprint["fingerprint"],
        )
        for name, vector in request.steering.items():
            steering.add(name, vector)
    for monitor in request.monitors or ():
        if getattr(monitor, "action", None) != "steer":
            continue
        if steering is None:
            raise CaptureConfigError(
                f"ProbeMonitor({monitor.probe!r}, action='steer') steers, but the engine has no "
                "steering vectors; pass steering={name: SteeringVector}."
            )
        steering.check_terms(monitor.steer, f"ProbeMonitor({monitor.probe!r})")
    config = CaptureConfig(
        layers=resolve_layers(request.layers, num_layers) if request.layers is not None else (),
        # A pooling model reads its input in one pass: every row is an input (prompt) row.
        include_prefill=request.include_prefill or pooling,
        include_decode=request.include_decode and not pooling,
        last_prefill_token=request.last_prefill_token,
        last_decode_token=request.last_decode_token,
    )
    # Probes and readouts read their layers' taps, whether or not rows are captured there.
    read_layers = tuple(
        sorted(
            {
                *(probe_set.layers if probe_set else ()),
                *(
                    layer
                    for r in readouts.values()
                    if r.readout.site == "resid_post"
                    for layer in r.layers
                ),  # fmt: skip
            }
        )
    )
    # Readouts of the attention op's query read query taps instead.
    query_layers = sorted(
        {layer for r in readouts.values() if r.readout.site == "attn_q" for layer in r.layers}
    )
    banks = _banks(probe_set, steering)
    engine_kwargs = engine_config.capture_engine_kwargs(
        kwargs,
        config,
        read_layers,
        pooling,
        steering.layers if steering is not None else (),
        # Capture-only: nothing after the deepest tapped layer is computed.
        exit_after=max((*config.layers, *read_layers, *query_layers))
        if request.capture_only
        else None,
        query_layers=query_layers,
        banks=banks,
        readouts={source: r.loader_settings() for source, r in readouts.items()} or None,
        writes={option: w.instances for option, w in writes.items()} or None,
        # Requests may bring their own monitors: whenever probes or readouts can be watched.
        monitored=probe_set is not None
        or any(r.readout.flags_attribute for r in readouts.values()),
    )
    legacy = legacy_fingerprint(hf_config)  # only compared with pre-v2 stores
    store = os.fspath(request.store) if request.store is not None else None
    if store is not None:  # fail before a minute of engine start-up, not after
        lane = (request.store_options or {}).get("lane")
        WriterLock.check_free(store, check_lane_name(lane) if lane is not None else ROOT_LANE)
        ActivationStore.check_appendable(
            store, fingerprint_meta(fingerprint), legacy_fingerprint=legacy
        )
    return CaptureSetup(
        config,
        probe_set,
        engine_kwargs,
        fingerprint,
        legacy,
        limit,
        store,
        dict(request.store_options or {}),
        steering,
        banks,
        readouts,
        writes,
    )


def _write_sets(given: dict[str, Any], engine: EngineFacts) -> dict[str, WriteSet]:
    """The engine's write-table entries: each intervention's instances checked against the
    model (their sites and layers too); an entry with none installs nothing."""
    entries = interventions(OUTPUT_PROCESSORS)
    sets = {}
    for option, value in given.items():
        entry = entries[option]
        instances = entry.instances(value, engine)
        for name, settings in instances.items():
            check_site(entry, name, settings, engine.num_layers)
        if instances:
            sets[option] = WriteSet(entry, instances)
    return sets


def _readout_sets(
    request: CaptureRequest,
    num_layers: int,
    hidden_size: int,
    model_name: str | None = None,
    vocab_size: int | None = None,
) -> dict[str, ReadoutSet]:
    """The engine's top-k readouts (registered output processors), checked against the
    model; a source nobody registered is refused, naming those that are."""
    registered = top_k_readouts(OUTPUT_PROCESSORS)
    sets = {}
    for source, specs in (request.readouts or {}).items():
        readout = registered.get(source)
        if readout is None:
            raise CaptureConfigError(
                f"readouts={{{source!r}: ...}}: no top-k readout {source!r} is registered; "
                f"registered: {sorted(registered)} (OUTPUT_PROCESSORS.register or the "
                "'probehook.output_processors' entry points)."
            )
        k = (request.readout_top_k or {}).get(source)
        extras = (request.readout_extras or {}).get(source)
        monitors = [m for m in request.monitors or () if getattr(m, "source", None) == source]
        sets[source] = ReadoutSet(readout, specs, k, num_layers=num_layers,
                                  hidden_size=hidden_size, extras=extras, model_name=model_name,
                                  monitors=monitors, vocab_size=vocab_size)  # fmt: skip
    unknown = sorted(set(request.readout_top_k or {}) - set(sets))
    if unknown:
        raise CaptureConfigError(f"readout_top_k names {unknown}, which the engine does not read.")
    return sets


def _banks(probes: ProbeSet | None, steering: SteeringSet | None) -> str | None:
    """The banks the workers allocate at model load, encoded (None: no probes, no
    steering)."""
    if probes is None and steering is None:
        return None
    return WorkerBanks(
        list(probes.specs) if probes is not None else [],
        steering.capacity if steering is not None else DEFAULT_CAPACITY,
        {
            name: vector_rows(vector)
            for name, vector in (steering.vectors if steering is not None else {}).items()
        },
    ).encode()


def capture_only_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Engine arguments of a capture-only engine: vLLM's pooling runner (one pass per request,
    nothing sampled); a generative model is served through vLLM's own ``convert="embed"``."""
    runner = kwargs.get("runner", "auto")
    if runner not in ("auto", "pooling"):
        raise CaptureConfigError(
            f"capture_only=True with runner={runner!r}: a capture-only engine runs vLLM's "
            "pooling runner (one pass per prompt). Drop runner=."
        )
    return {**kwargs, "runner": "pooling"}


def _monitorable(setup: CaptureSetup) -> bool:
    """Whether requests may bring stop monitors: of probes or of a top-k readout that has
    monitors (SAE features, lenses)."""
    return setup.probes is not None or any(
        r.readout.flags_attribute for r in setup.readouts.values()
    )


def start(
    setup: CaptureSetup,
    model: str,
    infos: list[Any],
    rpc: Rpc,
    abort: Callable[[list[str]], None],
    stop_token: int | None,
) -> tuple[CaptureSession, dict[str, Any], ActivationStore | None]:
    """The front end's session, the tapped worker's report, and the open store (if any),
    given the workers' replies to ``probehook_start_recording``."""
    infos = [info for info in infos if info]
    if not infos:
        raise CaptureError("No vLLM worker reported probehook taps.")
    session = CaptureSession(
        setup.config,
        rpc=rpc,
        abort=abort,
        decorate=outputs.decorate,
        probes=setup.probes,
        stop_token=stop_token if _monitorable(setup) else None,
        steering=setup.steering,
        readouts=setup.readouts,
        writes=setup.writes,
    )
    session.row_format = (int(infos[0]["hidden_size"]), _torch_dtype(infos[0]["dtype"]))
    store = None
    if setup.store is not None:
        store = _open_store(setup, model, infos[0])
        session.store = store
    return session, infos[0], store


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise CaptureError(f"A worker reported rows of unknown dtype {name!r}.")
    return dtype


def _open_store(setup: CaptureSetup, model: str, info: dict[str, Any]) -> ActivationStore:
    import vllm

    assert setup.store is not None
    meta = {
        "model": model,
        **fingerprint_meta(setup.fingerprint),
        "dtype": info["dtype"].removeprefix("torch."),
        "hidden_size": info["hidden_size"],
        "layers": list(setup.config.layers),
        "probehook_version": probehook_version,
        "vllm_version": vllm.__version__,
    }
    options = {**setup.store_options, "legacy_fingerprint": setup.legacy_fingerprint}
    store = ActivationStore.for_writing(setup.store, meta, **options)
    run: dict[str, Any] = {"capture": setup.config.to_dict()}
    for readout_set in setup.readouts.values():  # each instance under its stored name
        run.setdefault(RUN_TOP_K_KEY, {}).update(readout_set.store_description())
    store.begin_run(run)
    return store


def eos_token(get_tokenizer: Callable[[], Any]) -> int | None:
    """The token a stop monitor forces: the model's EOS (None without a tokenizer, as with
    ``skip_tokenizer_init=True``; a stop monitor then fails clearly when used)."""
    try:
        tokenizer = get_tokenizer()
    except ValueError:
        return None
    eos = getattr(tokenizer, "eos_token_id", None)
    return eos if isinstance(eos, int) else None


def fingerprint_meta(fingerprint: dict[str, Any]) -> dict[str, Any]:
    """The meta.json keys of a ``model_fingerprint`` result."""
    return {
        "model_fingerprint": fingerprint["fingerprint"],
        "fingerprint_version": fingerprint["version"],
        "fingerprint_covers": fingerprint["covers"],
    }


def _check_readouts(
    readouts: Mapping[str, ReadoutSet], pooling: bool, converted: bool, tp: int
) -> None:
    """Refuse a top-k readout where it cannot run: one that reads the model's next-token
    prediction (lenses) on a pooling model that has no LM head (one vLLM did not convert
    from a generative model, as it does for capture-only engines); one not built for tensor
    parallelism under it."""
    for readout_set in readouts.values():
        readout = readout_set.readout
        option = readout.engine_option
        if readout.reads_next_token and pooling and not converted:
            raise CaptureConfigError(
                f"{option}= reads the model's next-token prediction, and this is a pooling "
                "model with no LM head; drop it, or serve a generative model (capture-only "
                "engines and runner='pooling' on a generative model read lenses)."
            )
        if tp > 1 and not readout.tensor_parallel:
            raise CaptureConfigError(
                f"{option}= is not available with tensor_parallel_size={tp} yet (each rank "
                "holds a shard of the vocabulary); use tensor_parallel_size=1."
            )


def _check_pooling(request: CaptureRequest, architectures: Any) -> None:
    """Options that only mean something when a model generates tokens."""
    model = ", ".join(architectures or ["this model"])
    if request.monitors:
        raise CaptureConfigError(
            f"monitors= stop or flag generation, but {model} is a pooling model: it generates "
            "nothing. Drop monitors=; probe scores still come back on every output "
            "(output.probe_scores)."
        )
    if request.last_decode_token:
        raise CaptureConfigError(
            f"last_decode_token=True, but {model} is a pooling model with no decode tokens; "
            "use last_prefill_token=True to keep only the last input token's row."
        )
    if request.steers:
        raise CaptureConfigError(
            f"steering= is not supported on {model}, a pooling model: probehook steers "
            "generative models only. Drop steering= and steering_layers=."
        )
    entries = interventions(OUTPUT_PROCESSORS)
    for option in request.writes or {}:
        raise CaptureConfigError(
            f"{entries[option].engine_option}= is not supported on {model}, a pooling model: "
            f"probehook writes ({entries[option].name}) in generative models only. Drop it."
        )


def _check_limit(limit: int | None) -> int:
    if limit is None:
        return 0
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise CaptureConfigError(
            f"max_request_capture_bytes={limit!r} must be a non-negative int (bytes), or None "
            "for no limit."
        )
    return limit


def steering_of(capture: CaptureSession | None) -> SteeringSet:
    """The front end's steering set, or a clear error for an engine built without one."""
    if capture is None or capture.steering is None:
        raise CaptureConfigError(
            "This engine was built without steering; pass steering={name: SteeringVector} or "
            "steering_layers=[...] at construction."
        )
    return capture.steering
