"""``probehook serve MODEL --layers ... --probe NAME=PATH ... [vllm serve flags]``: vLLM's own
OpenAI-compatible server with a probehook
:class:`~probehook.adapter.frontend.async_engine.AsyncLLM` inside.

The command parses with ``vllm serve``'s own parser plus a probehook group, so every ``vllm
serve`` flag works. :func:`serve` follows vLLM's ``build_and_serve``: build the app, let vLLM
initialise its state, then :func:`probehook.adapter.server.serving.install` the capture handlers
and add ``GET /v1/probehook`` (what the server captures). One step is added to vLLM's sequence
instead of an endpoint plugin, because endpoint plugins load only when named in ``VLLM_PLUGINS``
and would also load in a plain ``vllm serve``, whose engine cannot capture.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import dataclass
from typing import Any

from probehook.adapter import vllm_names
from probehook.core.monitors import ProbeMonitor
from probehook.errors import CaptureConfigError
from probehook.outputs import OUTPUT_PROCESSORS, registered_readouts
from probehook.outputs.intervention import interventions

MiB = 1 << 20


def add_capture_args(parser: Any) -> None:
    group = parser.add_argument_group(
        "probehook", "What the server may capture; each request opts in with a 'probehook' field."
    )
    group.add_argument(
        "--layers", default=None, help="layers requests may ask hidden states of: '1,5' or 'all'"
    )
    group.add_argument(
        "--probe",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a probe file (safetensors) requests may ask scores of; repeatable",
    )
    group.add_argument(
        "--top-k-encoding",
        "--sae-encoding",
        dest="sae_encoding",
        default="lists",
        choices=["lists", "base64"],
        help="how every top-k reading (SAE features, lenses, any registered readout) is written "
        "into responses: JSON lists (default) or base64 arrays (int32 indices, float32 values, "
        "the scalar column; decode with decode_array); --sae-encoding is its older name",
    )
    group.add_argument(
        "--monitor",
        action="append",
        default=[],
        metavar="SPEC",
        help="PROBE:ACTION:THRESHOLD[:DIRECTION[:LABEL]] (e.g. truth:stop:0.9) or a JSON object; "
        "acts on requests that ask for its probe; repeatable",
    )
    group.add_argument(
        "--steer",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a steering vector file (safetensors, SteeringVector.save) requests may steer with "
        '("probehook": {"steer": {"NAME": scale}}); repeatable',
    )
    group.add_argument(
        "--steering-layers",
        default=None,
        help="more layers to give a steering op than the --steer vectors' own ('1,5' or 'all')",
    )
    group.add_argument(
        "--steering-capacity",
        type=int,
        default=None,
        help="the most steering vectors the engine's bank holds (default 64)",
    )
    group.add_argument(
        "--allow-inline-steering",
        action="store_true",
        help='let requests send their own steering vectors ("steer_vectors": {"NAME": {"LAYER": '
        "[floats]}}), checked like --steer's; off by default",
    )
    group.add_argument(
        "--allow-steering-edits",
        action="store_true",
        help="serve POST /v1/steering (add a named vector with its op: add, ablate, cap, "
        "orthogonal, norm_scaled, swap) and DELETE /v1/steering/NAME; off by default",
    )
    group.add_argument(
        "--include-prefill",
        action="store_true",
        help="let requests ask for prompt rows and scores too",
    )
    group.add_argument(
        "--store", default=None, help="also store every captured request in this directory"
    )
    group.add_argument(
        "--store-flush-interval",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="commit stored requests at least this often (default 5; 0: only when a shard "
        "fills and at shutdown)",
    )
    group.add_argument(
        "--capture-default",
        default=None,
        metavar="JSON",
        help="the probehook object of completion and chat requests that carry none, for "
        "clients that cannot add a field to the body (e.g. "
        '\'{"probes": true, "layers": [3]}\'); a request\'s own object wins, {} opts out',
    )
    group.add_argument(
        "--ui",
        action="store_true",
        help="serve the live viewer at /probehook/ui: a chat box whose reply is painted token "
        "by token with its readings (off unless asked)",
    )
    for flag in readout_flags():
        group.add_argument(flag.flag, **flag.argparse())
    for entry in interventions(OUTPUT_PROCESSORS).values():
        group.add_argument(write_flag(entry), **_write_argparse(entry))
    group.add_argument(
        "--readout",
        action="append",
        default=[],
        metavar="SOURCE:NAME=SPEC",
        help="an instance of a registered top-k readout (repeatable): its source, a name, and "
        "the spec its engine option takes (e.g. a layer)",
    )
    group.add_argument(
        "--readout-top-k",
        action="append",
        default=[],
        metavar="SOURCE=K",
        help="entries kept per token of a top-k readout (default: the readout's own)",
    )
    group.add_argument(
        "--max-capture-response-mb",
        type=float,
        default=64.0,
        help="refuse (400) requests whose hidden states could exceed this (default 64)",
    )


def capture_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``AsyncLLM`` capture arguments from the parsed flags; bad flags exit with a message."""
    from probehook.capture_config import parse_layers

    probes = _named_paths("--probe", args.probe, "truth=probe.st")
    steering = _named_paths("--steer", args.steer, "calm=calm.st")
    if args.steering_capacity is not None and args.steering_capacity < 1:
        raise SystemExit("error: --steering-capacity must be a positive number of vectors")
    try:
        monitors = [parse_monitor(spec) for spec in args.monitor]
    except CaptureConfigError as e:
        raise SystemExit(f"error: {e}") from None
    if args.max_capture_response_mb <= 0:
        raise SystemExit("error: --max-capture-response-mb must be positive")
    if args.store_flush_interval < 0:
        raise SystemExit("error: --store-flush-interval must be 0 (off) or positive seconds")
    layers = parse_layers(args.layers) if args.layers is not None else None
    steering_layers = (
        parse_layers(args.steering_layers) if args.steering_layers is not None else None
    )
    return dict(
        **_readout_options(args),
        **_write_options(args),
        layers=layers,
        probes=probes or None,
        monitors=monitors or None,
        include_prefill=args.include_prefill,
        store=args.store,
        # A server runs for weeks and nobody reads its store through it: it keeps the ids of
        # what it wrote (for the duplicate check), not every record (4 KB each in the soak).
        store_options={"keep_index": False} if args.store else None,
        steering=steering or None,
        steering_layers=steering_layers,
        steering_capacity=args.steering_capacity,
        readouts=_readouts(args.readout) or None,
        readout_top_k=_readout_top_k(args.readout_top_k) or None,
    )


@dataclass(frozen=True)
class ReadoutFlag:
    """One flag ``probehook serve`` generates from a registered top-k readout's engine
    options: its instances (``--lens NAME=SPEC``, repeatable), its k, its further options."""

    readout: Any
    option: str
    """The engine option it sets (``"lenses"``, ``"lens_top_k"``, ``"lens_layers"``)."""

    @property
    def instances(self) -> bool:
        return self.option == self.readout.engine_option

    @property
    def flag(self) -> str:
        name = self.readout.cli_flag if self.instances and self.readout.cli_flag else self.option
        return "--" + name.replace("_", "-")

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")

    def argparse(self) -> dict[str, Any]:
        readout = self.readout
        default_help = (
            f"an instance of the {readout.name} readout (repeatable)"
            if self.instances
            else f"entries a {readout.name} reading keeps per token (default {readout.default_k})"
            if self.option == readout.k_option
            else f"the {readout.name} readout's {self.option} engine option"
        )
        out: dict[str, Any] = {"help": readout.cli_help.get(self.option, default_help)}
        if self.instances and readout.cli_named:
            out.update(action="append", default=[], metavar="NAME=SPEC")
        elif self.instances:  # one value (attention's "2,5")
            out.update(default=None, metavar="VALUE")
        elif self.option in readout.cli_switches:
            out.update(action="store_true", default=None)
        else:
            out.update(default=None)
            if self.option in readout.cli_choices:
                out["choices"] = readout.cli_choices[self.option]
        return out


def readout_flags() -> list[ReadoutFlag]:
    """The flags of every registered top-k readout's engine options (a readout registered
    through the entry point gets its flags as a built-in one does)."""
    return [
        ReadoutFlag(readout, option)
        for readout in registered_readouts().values()
        for option in readout.engine_options
    ]


def _readout_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options of the readouts whose flags were given; an option flag without its
    readout's instances exits with a message."""
    out: dict[str, Any] = {}
    flags = readout_flags()
    named = {f.readout.source: f for f in flags if f.instances}
    for flag in flags:
        given = getattr(args, flag.dest, None)
        if flag.instances or given is None or given is False:  # False: a switch not given
            continue
        if flag.option == flag.readout.k_option:
            text = str(given).strip()
            if not text.isdigit() or int(text) < 1:
                raise SystemExit(f"error: {flag.flag} must be a positive number of entries")
        owner = named[flag.readout.source]
        if not getattr(args, owner.dest, None):
            raise SystemExit(f"error: {flag.flag} needs {owner.flag} NAME=SPEC")
        try:
            out[flag.option] = flag.readout.cli_value(flag.option, given)
        except ValueError as e:
            raise SystemExit(f"error: {flag.flag} {given!r}: {e}") from None
    for flag in named.values():
        items = getattr(args, flag.dest, None) or []
        if items and not flag.readout.cli_named:
            try:
                out[flag.option] = flag.readout.cli_value(flag.option, items)
            except ValueError as e:
                raise SystemExit(f"error: {flag.flag} {items!r}: {e}") from None
        elif items:
            out[flag.option] = _named_paths(flag.flag, items, "NAME=SPEC")
    return out


def write_flag(entry: Any) -> str:
    """The flag ``probehook serve`` generates from a registered intervention's engine option
    (``--sae-clamping``, a third party's ``--scale-layers``)."""
    return "--" + (entry.cli_flag or entry.engine_option).replace("_", "-")


def _write_argparse(entry: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "help": entry.cli_help or f"the {entry.name} intervention's engine option",
        "dest": write_flag(entry)[2:].replace("-", "_"),
    }
    if entry.cli_switch:
        out.update(action="store_true", default=None)
    else:
        out.update(default=None, metavar="VALUE")
    return out


def _write_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options of the interventions whose flags were given."""
    out = {}
    for entry in interventions(OUTPUT_PROCESSORS).values():
        given = getattr(args, write_flag(entry)[2:].replace("-", "_"), None)
        if given is not None and given is not False:
            out[entry.engine_option] = entry.cli_value(given)
    return out


def _readouts(items: list[str]) -> dict[str, dict[str, str]]:
    """``--readout SOURCE:NAME=SPEC`` flags as ``{source: {name: spec}}``."""
    out: dict[str, dict[str, str]] = {}
    for item in items:
        head, sep, spec = item.partition("=")
        source, colon, name = head.partition(":")
        if not sep or not colon or not source or not name or not spec:
            raise SystemExit(f"error: --readout {item!r} must be SOURCE:NAME=SPEC (e.g. norm:n3=3)")
        if name in out.setdefault(source, {}):
            raise SystemExit(f"error: --readout {source}:{name} is given twice")
        out[source][name] = spec
    return out


def _readout_top_k(items: list[str]) -> dict[str, int]:
    """``--readout-top-k SOURCE=K`` flags."""
    out = {}
    for item in items:
        source, sep, k = item.partition("=")
        if not sep or not source or not k.isdigit() or int(k) < 1:
            raise SystemExit(f"error: --readout-top-k {item!r} must be SOURCE=K, K >= 1")
        out[source] = int(k)
    return out


def _named_paths(flag: str, items: list[str], example: str) -> dict[str, str]:
    """``NAME=PATH`` flags as a dict; a malformed or repeated name exits with a message."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"error: {flag} {item!r} must be NAME=PATH (e.g. {example})")
        if name in out:
            raise SystemExit(f"error: {flag} {name} is given twice")
        out[name] = path
    return out


def parse_capture_default(text: str | None) -> dict[str, Any] | None:
    """``--capture-default``'s JSON object (None: not given); bad JSON or a non-object exits
    with a message before the engine starts. Option names and values are checked against the
    engine once it is up (:func:`check_capture_default`)."""
    if text is None:
        return None
    example = '\'{"probes": true, "layers": [3]}\''
    try:
        value = json.loads(text)
    except ValueError as e:
        raise SystemExit(
            f"error: --capture-default {text!r} is not valid JSON ({e}); pass an object such "
            f"as {example}."
        ) from None
    if not isinstance(value, dict):
        raise SystemExit(
            f"error: --capture-default must be a JSON object of per-request probehook options "
            f"(layers, probes, monitors, include_prefill, ...), such as {example}; got "
            f"{text!r}."
        )
    return value


def check_capture_default(engine: Any, default: dict[str, Any] | None, tasks: Any) -> None:
    """Refuse (exit) a ``--capture-default`` this engine cannot serve: unknown options, layers
    or probes it does not capture, or a model with no completion route."""
    if default is None:
        return
    from vllm import SamplingParams

    from probehook.core.request_options import EXTRA_ARGS_KEY
    from probehook.frontend.response_fields import request_options

    if "generate" not in tasks:
        raise SystemExit(
            "error: --capture-default applies to /v1/completions and /v1/chat/completions, which "
            f"this model does not serve (its tasks: {sorted(tasks)}). Pooling requests opt in "
            "with their own probehook object; drop --capture-default."
        )
    try:
        options = request_options(default, engine.readout_options)
        engine.check_request(SamplingParams(extra_args={EXTRA_ARGS_KEY: options}))
    except (CaptureConfigError, TypeError, ValueError) as e:
        raise SystemExit(
            f"error: --capture-default {json.dumps(default)} cannot be served by this engine: {e}"
        ) from None


def parse_monitor(spec: str) -> ProbeMonitor:
    """``truth:stop:0.9``, ``truth:flag:0.2:below``, or ``{"probe": "truth", ...}``."""
    if spec.lstrip().startswith("{"):
        try:
            return ProbeMonitor.coerce(json.loads(spec))
        except ValueError as e:
            raise CaptureConfigError(f"--monitor {spec!r} is not valid JSON: {e}") from None
    parts = spec.split(":")
    if not 3 <= len(parts) <= 5:
        raise CaptureConfigError(
            f"--monitor {spec!r} must be PROBE:ACTION:THRESHOLD[:DIRECTION[:LABEL]], "
            "e.g. truth:stop:0.9, or a JSON object."
        )
    try:
        threshold = float(parts[2])
    except ValueError:
        raise CaptureConfigError(
            f"--monitor {spec!r}: threshold {parts[2]!r} is not a number"
        ) from None
    keys = ("direction", "label")
    return ProbeMonitor(parts[0], threshold, parts[1], **dict(zip(keys, parts[3:], strict=False)))


def parse_args(argv: list[str]) -> argparse.Namespace:
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    make_arg_parser = vllm_names.resolve("make_arg_parser")
    validate_parsed_serve_args = vllm_names.resolve("validate_parsed_serve_args")

    parser = FlexibleArgumentParser(
        prog="probehook serve",
        description="vLLM's OpenAI-compatible server, with residual-stream capture and probes.",
    )
    parser = make_arg_parser(parser)
    add_capture_args(parser)
    args = parser.parse_args(argv)
    if getattr(args, "model_tag", None) is not None:
        args.model = args.model_tag
    validate_parsed_serve_args(args)
    for flag, bad in (
        ("--headless", args.headless),
        ("--grpc", getattr(args, "grpc", False)),
        ("--api-server-count > 1", (args.api_server_count or 1) > 1),
        ("--data-parallel-size > 1", args.data_parallel_size > 1),
    ):
        if bad:
            raise SystemExit(
                f"error: probehook serve runs one API server around one engine; {flag} is not "
                "supported (capture across data-parallel engines is not built yet)."
            )
    return args


def main(argv: list[str]) -> None:
    import uvloop
    from vllm.logger import configure_logging_from_args

    vllm_names.resolve("cli_env_setup")()
    args = parse_args(argv)
    capture = capture_kwargs(args)
    args.capture_default = parse_capture_default(args.capture_default)
    configure_logging_from_args(args)
    uvloop.run(serve(args, capture))


async def serve(args: argparse.Namespace, capture: dict[str, Any]) -> None:
    """Start the engine and vLLM's app around it; return when the server shuts down."""
    import vllm.envs as envs
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import serve_http, setup_server
    from vllm.entrypoints.launchers.utils.server_utils import get_uvicorn_log_config
    from vllm.usage.usage_lib import UsageContext

    from probehook.adapter.frontend.async_engine import AsyncLLM
    from probehook.adapter.server.serving import install

    listen_address, sock = setup_server(args, reuse_port=False)
    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs.from_cli_args(args),
        usage_context=UsageContext.OPENAI_API_SERVER,
        **capture,
    )
    flusher = None
    engine.capture_unmarked = False  # opt-in: a request captures only what it asks for
    try:
        await engine.start_capture()
        if engine.store is not None and args.store_flush_interval > 0:
            flusher = asyncio.create_task(_flush_store(engine, args.store_flush_interval))
        tasks = await engine.get_supported_tasks()
        default = getattr(args, "capture_default", None)
        check_capture_default(engine, default, tasks)
        app = build_app(args, tasks, engine.model_config)
        await init_app_state(engine, app.state, args, tasks)
        limit = int(args.max_capture_response_mb * MiB)
        install(
            app.state,
            limit,
            default,
            args.allow_inline_steering,
            compact=args.sae_encoding == "base64",
        )
        app.add_api_route("/v1/probehook", _describe(engine, limit, default), methods=["GET"])
        if args.allow_steering_edits:
            _add_steering_routes(app, engine)
        if "patch" in engine.session.writes:  # --patching
            _add_patch_sweep_route(app, engine)
        if args.ui:
            _add_ui(app)
        uvicorn_kwargs: dict[str, Any] = {}
        log_config = get_uvicorn_log_config(args)
        if log_config is not None:
            uvicorn_kwargs["log_config"] = log_config
        shutdown = await serve_http(
            app,
            sock=sock,
            enable_ssl_refresh=args.enable_ssl_refresh,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
            timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
            ssl_keyfile=args.ssl_keyfile,
            ssl_certfile=args.ssl_certfile,
            ssl_ca_certs=args.ssl_ca_certs,
            ssl_cert_reqs=args.ssl_cert_reqs,
            ssl_ciphers=args.ssl_ciphers,
            h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
            h11_max_header_count=args.h11_max_header_count,
            **uvicorn_kwargs,
        )
        await shutdown
    finally:
        if flusher is not None:
            flusher.cancel()
        engine.shutdown()
        sock.close()


async def _flush_store(engine: Any, interval: float) -> None:
    """Commit stored requests every ``interval`` seconds, off the event loop (on the engine's
    store thread, after the adds queued there), so that a crash loses at most the last
    interval's records. Stops once the engine shuts down (its store's close commits the
    rest)."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(interval)
        store = engine.store
        if getattr(engine, "_shut_down", False) or store is None:
            return
        if store.unflushed:
            await loop.run_in_executor(engine.store_thread, store.flush)


def _add_ui(app: Any) -> None:
    """``GET /probehook/ui``: the live viewer (``--ui``; no route without it)."""
    from fastapi.responses import HTMLResponse

    from probehook.viewer.live import ROUTE, live_page

    page = live_page()

    async def ui() -> HTMLResponse:
        return HTMLResponse(page)

    app.add_api_route(ROUTE, ui, methods=["GET"])


def _bad_request(message: str, param: str) -> Any:
    """A 400 in the OpenAI error form vLLM's own routes answer."""
    from fastapi.responses import JSONResponse

    error = {"message": message, "type": "BadRequestError", "param": param, "code": 400}
    return JSONResponse({"error": error}, status_code=400)


def _add_steering_routes(app: Any, engine: Any) -> None:
    """``POST /v1/steering`` ``{"name", "vectors": {"LAYER": [floats]}, "op", "min", "max",
    "to"}`` puts a named vector with its op in the bank; ``DELETE /v1/steering/NAME`` takes it
    out. A bad body or a refusal (a name taken, an unsteered layer, a full bank, a vector in
    use) is a 400 naming it."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    from probehook.adapter.server.serving import vector_from_json
    from probehook.core.steering_ops import describe_op
    from probehook.errors import CaptureConfigError
    from probehook.frontend.steering_set import INLINE_PREFIX

    def refused(message: str) -> JSONResponse:
        return _bad_request(message, "steering")

    async def add(request: Any) -> Any:
        try:
            body = await request.json()
        except ValueError as e:
            return refused(f"POST /v1/steering takes a JSON object: {e}")
        name = body.get("name") if isinstance(body, dict) else None
        if not isinstance(name, str) or not name or name.startswith(INLINE_PREFIX):
            return refused(
                f'POST /v1/steering needs a "name" (a non-empty string not starting with '
                f'{INLINE_PREFIX!r}) and "vectors", got {str(body)[:120]}'
            )
        if "vectors" not in body:
            return refused('POST /v1/steering needs "vectors": {"LAYER": [floats]}')
        rest = {k: v for k, v in body.items() if k != "name"}
        try:
            vector = vector_from_json(name, rest, f"POST /v1/steering {name!r}")
            await engine.add_steering(name, vector)
        except CaptureConfigError as e:
            return refused(str(e))
        return {"name": name, "op": describe_op(vector.op, vector.op_params),
                "layers": list(vector.layers), "digest": vector.digest}  # fmt: skip

    async def remove(name: str) -> Any:
        if name.startswith(INLINE_PREFIX):
            return refused(f"{name!r} is a request's inline vector; it leaves with its request")
        try:
            await engine.remove_steering(name)
        except CaptureConfigError as e:
            return refused(str(e))
        return {"name": name, "removed": True}

    add.__annotations__["request"] = Request  # FastAPI reads it (the module's are strings)
    app.add_api_route("/v1/steering", add, methods=["POST"])
    app.add_api_route("/v1/steering/{name}", remove, methods=["DELETE"])


SWEEP_FIELDS = ("prompt", "clean_prompt", "source_run", "hook", "layers", "positions", "alpha",
                "answer_token", "answer_token_id", "foil_token", "foil_token_id", "metric",
                "stream", "model")  # fmt: skip
"""``POST /v1/patch_sweep``'s fields: the RhizoNymph vLLM fork's names (``model`` ignored)."""


def _add_patch_sweep_route(app: Any, engine: Any) -> None:
    """``POST /v1/patch_sweep`` (``--patching``): :meth:`AsyncLLM.patch_sweep` with the fork's
    field names and response fields; ``"stream": true`` sends one server-sent event per cell
    as it finishes (``{"layer", "position", "value", "pair"}``), then the result, then
    ``[DONE]``. ``prompt`` and ``clean_prompt`` may be lists of pairs (``grids``, ``ci``).
    ``source_run`` names the clean run: a later sweep that sends the same name without
    ``clean_prompt`` runs against it again (its clean run is recomputed, one prefill); an
    unknown name is a 400."""
    import asyncio
    import json

    from fastapi import Request
    from fastapi.responses import JSONResponse, StreamingResponse

    from probehook.errors import CaptureConfigError

    runs: dict[str, Any] = {}

    def refused(message: str) -> JSONResponse:
        return _bad_request(message, "patch_sweep")

    async def sweep(request: Any) -> Any:
        try:
            body = await request.json()
        except ValueError as e:
            return refused(f"POST /v1/patch_sweep takes a JSON object: {e}")
        if not isinstance(body, dict):
            return refused("POST /v1/patch_sweep takes a JSON object")
        unknown = sorted(set(body) - set(SWEEP_FIELDS))
        if unknown:
            return refused(f"unknown fields {unknown}; the fields are {list(SWEEP_FIELDS)}")
        asked = {k: v for k, v in body.items() if k not in ("source_run", "stream", "model")}
        name = body.get("source_run")
        if name is not None and not isinstance(name, str):
            return refused(f"source_run={name!r} must be a string")
        if "clean_prompt" not in asked:
            if name is None or name not in runs:
                return refused(
                    f"source_run {name!r} names no clean run of this server; send clean_prompt"
                    if name is not None
                    else "send clean_prompt (or the source_run of an earlier sweep)"
                )
            asked["clean_prompt"] = runs[name]
        if body.get("stream"):
            return StreamingResponse(_streamed(asked, name), media_type="text/event-stream")
        try:
            result = await engine.patch_sweep(**asked)
        except (CaptureConfigError, TypeError) as e:
            return refused(str(e))
        if name is not None:
            runs[name] = asked["clean_prompt"]
        return result.to_dict()

    async def _streamed(asked: dict[str, Any], name: str | None) -> Any:
        cells: asyncio.Queue = asyncio.Queue()

        def on_cell(layer: int, position: int, value: float, pair: int) -> None:
            cells.put_nowait({"layer": layer, "position": position, "value": value, "pair": pair})

        task = asyncio.ensure_future(engine.patch_sweep(on_cell=on_cell, **asked))
        task.add_done_callback(lambda _: cells.put_nowait(None))  # the last event: done
        while (event := await cells.get()) is not None:
            yield f"data: {json.dumps(event)}\n\n"
        try:
            result = task.result()
        except (CaptureConfigError, TypeError) as e:
            yield f"data: {json.dumps({'error': {'message': str(e), 'code': 400}})}\n\n"
        else:
            if name is not None:
                runs[name] = asked["clean_prompt"]
            yield f"data: {json.dumps(result.to_dict())}\n\n"
        yield "data: [DONE]\n\n"

    sweep.__annotations__["request"] = Request  # FastAPI reads it (the module's are strings)
    app.add_api_route("/v1/patch_sweep", sweep, methods=["POST"])


def _describe(engine: Any, limit: int, default: dict[str, Any] | None = None) -> Any:
    """``GET /v1/probehook``: what requests may ask this server for."""
    config, probes = engine.capture_config, engine.probes
    info = getattr(engine, "capture_info", {})
    session = getattr(engine, "session", None)
    readouts = session.readouts if session is not None else {}
    body = {
        "layers": list(config.layers) if config is not None else [],
        "include_prefill": bool(config is not None and config.include_prefill),
        "probes": (
            {
                name: {"layer": p.layer, "kind": p.kind, "labels": p.label_names}
                for name, p in probes.probes.items()
            }
            if probes
            else {}
        ),
        "monitors": [m.to_dict() for m in probes.monitors] if probes else [],
        # Each top-k readout by its engine option (a lens: "lenses"), with the request
        # options that ask it.
        "readouts": {r.readout.engine_option: r.describe() for r in readouts.values()},
        # And each registered readout's instances by its engine option (SAEs' older field,
        # kept), empty where the engine does not read it.
        **{
            r.engine_option: sorted(r.pickable(readouts[s].instances)) if s in readouts else []
            for s, r in registered_readouts().items()
            if r.engine_option not in ("readouts", "layers", "probes", "monitors")
        },
        # Each write-table entry by its request option: its engine option and instances.
        "writes": {
            option: {
                "engine_option": w.entry.engine_option,
                "name": w.entry.name,
                "instances": w.instances,
            }  # fmt: skip
            for option, w in (session.writes if session is not None else {}).items()
        },
        "hidden_size": info.get("hidden_size"),
        "dtype": str(info.get("dtype", "")).removeprefix("torch.") or None,
        "max_capture_response_bytes": limit,
        "capture_default": default,
    }

    async def describe() -> dict[str, Any]:
        # The steering bank changes while the server runs (inline vectors come and go).
        return {**body, "steering": engine.steering_info()}

    return describe
