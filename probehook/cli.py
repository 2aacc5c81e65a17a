"""The ``probehook`` command line: ``probehook capture ...``, ``probehook serve MODEL ...`` and
``probehook store info | fsck | compact | export PATH``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from probehook.capture_config import parse_layers

DESCRIPTION = """\
probehook: vLLM generation with residual-stream capture, activation stores and probes.

  probehook serve MODEL --layers 3 [--probe NAME=PATH] [vllm serve flags]
  probehook capture --model MODEL --layers 1,3 --prompts FILE --store DIR
  probehook capture --model MODEL --layers 6 --prompts FILE --store DIR --replicas 2
  probehook store info | fsck | compact DIR
  probehook store export DIR OUT --format saelens|safetensors ...
"""


def read_prompts(path: Path) -> list[Any]:
    """Prompts of a prompts file (the format of ``probehook.collect.read_items``; ids unused
    here): text, or ``{"prompt_token_ids": [...]}`` for a list of token ids."""
    from probehook.collect.items import read_items
    from probehook.errors import CaptureConfigError

    if not path.is_file():
        raise SystemExit(f"error: prompts file {path} does not exist")
    try:
        items = read_items(path)
    except CaptureConfigError as e:
        raise SystemExit(f"error: {e}") from e
    return [
        i.prompt if isinstance(i.prompt, str) else {"prompt_token_ids": i.prompt} for i in items
    ]


def cmd_capture(args: argparse.Namespace) -> None:
    if args.replicas is not None or args.capture_only:
        cmd_collect(args)
        return
    if args.probe or args.ray_address:
        raise SystemExit("error: --probe and --ray-address are for collections (--replicas N)")
    if args.layers is None:
        raise SystemExit("error: --layers is required")
    prompts = read_prompts(Path(args.prompts))
    from tqdm.auto import tqdm
    from vllm import SamplingParams

    from probehook.adapter.frontend.offline import LLM

    llm = LLM(
        args.model,
        layers=parse_layers(args.layers),
        include_prefill=args.prefill,
        include_decode=not args.no_decode,
        store=args.store,
        max_model_len=args.max_model_len,
        enforce_eager=args.eager,
        dtype=args.dtype,
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    done = 0
    # Shut down and closed on the way out, also when called as a function (probehook.cli.main)
    with llm, tqdm(total=len(prompts), desc="captured", unit="prompt") as bar:
        for begin in range(0, len(prompts), args.batch_size):
            batch = prompts[begin : begin + args.batch_size]
            llm.generate(batch, params, use_tqdm=False)  # durable when it returns
            done += len(batch)
            bar.update(len(batch))
        assert llm.store is not None
        print(json.dumps(llm.store.info(), indent=2))


def cmd_collect(args: argparse.Namespace) -> None:
    """A capture-only collection: prompt rows only, resumable (a rerun skips stored items)."""
    from probehook.collect.collector import collect
    from probehook.errors import ProbehookError

    if args.max_tokens != 16 or args.no_decode or args.prefill:
        raise SystemExit(
            "error: a capture-only collection keeps prompt rows and generates nothing: drop "
            "--max-tokens, --prefill and --no-decode"
        )
    probes = {}
    for spec in args.probe or []:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"error: --probe {spec!r} must be NAME=PATH")
        probes[name] = path
    engine: dict[str, Any] = {"enforce_eager": args.eager, "dtype": args.dtype}
    if args.max_model_len is not None:
        engine["max_model_len"] = args.max_model_len
    if not Path(args.prompts).is_file():
        raise SystemExit(f"error: prompts file {args.prompts} does not exist")
    try:
        result = collect(
            args.model,
            Path(args.prompts),
            store=args.store,
            layers=parse_layers(args.layers) if args.layers else None,
            probes=probes or None,
            replicas=args.replicas or 1,
            batch_size=args.batch_size,
            ray_address=args.ray_address,
            replica_logs=args.replica_logs,
            **engine,
        )
    except ProbehookError as e:
        raise SystemExit(f"error: {e}") from e
    print(
        json.dumps(
            {
                "store": str(result.store),
                "items": result.items,
                "skipped (already stored)": result.skipped,
                "captured": result.captured,
                "tokens": result.tokens,
                "seconds": round(result.seconds, 3),
                "tokens_per_second": round(result.tokens_per_second, 1),
                "replicas": result.per_replica,
            },
            indent=2,
        )
    )


def cmd_store_info(args: argparse.Namespace) -> None:
    from probehook.errors import StoreFormatError
    from probehook.store import ActivationStore

    try:
        info: dict[str, Any] = ActivationStore.open(args.path).info()
    except StoreFormatError as e:
        raise SystemExit(f"error: {e}") from e
    for key, value in info.items():
        if key == "lanes":  # requests per lane; "" is the root lane
            value = ", ".join(f"{lane or '(root)'}: {n}" for lane, n in value.items())
        print(f"{key:>12}: {value}")


def cmd_store_fsck(args: argparse.Namespace) -> None:
    from probehook.errors import StoreError, StoreFormatError
    from probehook.store import ActivationStore
    from probehook.store.maintenance import fsck

    try:
        ActivationStore.open(args.path)  # a clear error if it is not a store
        report = fsck(args.path, repair=args.repair)
    except (StoreError, StoreFormatError) as e:
        raise SystemExit(f"error: {e}") from e
    print("\n".join(report.lines()))
    if not report.ok:
        raise SystemExit(1)


EXPORT_FLAGS = {  # option -> its flag: what a format may take on the command line
    "layer": "--layer",
    "layers": "--layers",
    "context_size": "--context-size",
    "phase": "--phase",
    "packing": "--packing",
    "hook_name": "--hook-name",
    "shard_tokens": "--shard-tokens",
    "dtype": "--dtype",
}


def cmd_store_export(args: argparse.Namespace) -> None:
    """``store.export`` from the shell: the options come from flags, checked here first so
    that every error names a flag."""
    import torch

    from probehook.errors import StoreError, StoreFormatError
    from probehook.store import ActivationStore
    from probehook.store.export import EXPORT_OPTIONS, export_option_names

    options: dict[str, Any] = {
        name: getattr(args, name) for name in EXPORT_FLAGS if getattr(args, name) is not None
    }
    try:
        store = ActivationStore.open(args.path)
    except (StoreError, StoreFormatError) as e:
        raise SystemExit(f"error: {e}") from e
    if "layers" in options:
        layers = parse_layers(options["layers"])
        options["layers"] = list(store.layers) if isinstance(layers, str) else list(layers)
    if "dtype" in options:
        dtype = getattr(torch, options["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise SystemExit(f"error: --dtype {options['dtype']!r} is not a torch dtype")
        options["dtype"] = dtype
    accepted = export_option_names(args.format)
    wrong = [EXPORT_FLAGS[name] for name in options if name not in accepted]
    if wrong:
        takes = [EXPORT_FLAGS[n] for n in EXPORT_FLAGS if n in accepted]
        raise SystemExit(f"error: --format {args.format} takes no {wrong}; it takes {takes}")
    missing = [
        f"{EXPORT_FLAGS[name]} ({meaning})"
        for name, meaning in EXPORT_OPTIONS[args.format].items()
        if name not in options
    ]
    if missing:
        raise SystemExit(f"error: --format {args.format} needs {'; '.join(missing)}")
    try:
        written = store.export(args.out, args.format, **options)
    except (StoreError, StoreFormatError, ValueError, TypeError) as e:
        raise SystemExit(f"error: {e}") from e
    if isinstance(written, list):
        print(f"{len(written)} shard(s) in {args.out}")
    else:
        print(written)


def cmd_store_compact(args: argparse.Namespace) -> None:
    from probehook.errors import StoreError, StoreFormatError
    from probehook.store.format import lane_label
    from probehook.store.maintenance import compact

    try:
        report = compact(args.path, shard_bytes=args.shard_bytes)
    except (StoreError, StoreFormatError) as e:
        raise SystemExit(f"error: {e}") from e
    several = len(report.lanes) + len(report.skipped) > 1
    if several:
        for lane, done in report.lanes.items():
            print(
                f"{lane_label(lane)}: {done.shards_before} shards -> {done.shards_after} "
                f"({done.merged} merged)"
                + (f"; previous manifest kept as {done.backup}" if done.backup else "")
            )
    for lane, why in report.skipped.items():
        print(f"{lane_label(lane)}: skipped: {why}")
    print(
        f"{report.shards_before} shards -> {report.shards_after} ({report.merged} merged, "
        f"{report.bytes_after:,} bytes)"
        + (f"; previous manifest kept as {report.backup}" if report.backup and not several else "")
    )
    if any("damaged" in why for why in report.skipped.values()):
        raise SystemExit(1)


MAX_VIEWED_RESPONSES = 200
"""Choices a page of a responses file shows without --id (a page per few hundred is usable)."""


def cmd_view(args: argparse.Namespace) -> None:
    """``probehook view STORE --id ID -o run.html`` (or a JSONL file of responses): the
    viewer's page."""
    from probehook.viewer import view

    if Path(args.path).is_file():
        requests, model = _viewed_responses(args)
    else:
        requests, model = _viewed_store(args)
    source = args.tokenizer or model
    tokenizer = None
    if source:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError) as e:
            raise SystemExit(
                f"error: cannot load the tokenizer from {source!r} ({e}); pass --tokenizer PATH"
            ) from e
    path = view(requests, tokenizer).save(args.output)
    print(f"wrote {path} ({len(requests)} request(s))")


def _viewed_store(args: argparse.Namespace) -> tuple[list[Any], str | None]:
    from probehook.errors import StoreError, StoreFormatError
    from probehook.store import ActivationStore

    if not args.id:
        raise SystemExit(f"error: {args.path} is a store: name the requests with --id STORE_ID")
    try:
        store = ActivationStore.open(args.path)
        return [store[store_id] for store_id in args.id], store.meta.get("model")
    except (StoreError, StoreFormatError, KeyError) as e:
        raise SystemExit(f"error: {e}") from e


def _viewed_responses(args: argparse.Namespace) -> tuple[list[Any], str | None]:
    from probehook.viewer.served import ResponseFileError, read_responses

    try:
        requests = list(read_responses(args.path, args.id))
    except ResponseFileError as e:
        raise SystemExit(f"error: {e}") from e
    if not requests:
        wanted = f" with the ids {args.id}" if args.id else ""
        raise SystemExit(f"error: {args.path} has no responses{wanted}")
    if len(requests) > MAX_VIEWED_RESPONSES:
        raise SystemExit(
            f"error: {args.path} has {len(requests)} choices; a page shows at most "
            f"{MAX_VIEWED_RESPONSES}: pick some with --id RESPONSE_ID"
        )
    return requests, requests[0].model


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # vLLM's own parser takes every `vllm serve` flag
        from probehook.adapter.server.serve import main as serve

        serve(argv[1:])
        return
    parser = argparse.ArgumentParser(
        prog="probehook",
        description=DESCRIPTION,  # plain text: the module docstring is reStructuredText
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "serve",
        help="vLLM's OpenAI-compatible server with capture and probes "
        "(probehook serve MODEL --layers ... --probe NAME=PATH; --help for every flag)",
    )
    cap = sub.add_parser(
        "capture",
        help="generate and stream captures into a store; with --replicas N (or "
        "--capture-only): a resumable capture-only collection (docs/collect.md)",
    )
    cap.add_argument("--model", required=True, help="model directory or name")
    cap.add_argument(
        "--layers", default=None, help="comma-separated layers, or 'all' (required unless --probe)"
    )
    cap.add_argument("--prompts", required=True, help="prompts file: .jsonl or plain text")
    cap.add_argument("--store", required=True, help="store directory (created or appended)")
    cap.add_argument("--prefill", action="store_true", help="also capture prompt rows")
    cap.add_argument("--no-decode", action="store_true", help="do not capture decode rows")
    cap.add_argument("--max-tokens", type=int, default=16)
    cap.add_argument("--temperature", type=float, default=0.0)
    cap.add_argument("--batch-size", type=int, default=64, help="prompts per durable batch")
    cap.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="a capture-only collection on N engines (N > 1: Ray actors, "
        "pip install 'probehook[ray]'); a rerun skips the items already stored",
    )
    cap.add_argument(
        "--capture-only",
        action="store_true",
        help="a capture-only collection in this process (--replicas 1)",
    )
    cap.add_argument(
        "--probe", action="append", metavar="NAME=PATH", help="a probe to score (collections)"
    )
    cap.add_argument("--ray-address", default=None, help="a Ray cluster to run replicas on")
    cap.add_argument(
        "--replica-logs", action="store_true", help="show the Ray replicas' engine logs here"
    )
    cap.add_argument("--max-model-len", type=int, default=None)
    cap.add_argument("--dtype", default="auto", help="model dtype, as vLLM's --dtype")
    cap.add_argument("--eager", action="store_true", help="enforce_eager (faster start-up)")
    cap.set_defaults(func=cmd_capture)
    store = sub.add_parser("store", help="inspect, check and compact a store")
    store_sub = store.add_subparsers(dest="store_command", required=True)
    info = store_sub.add_parser("info", help="summary of a store")
    info.add_argument("path")
    info.set_defaults(func=cmd_store_info)
    check = store_sub.add_parser(
        "fsck", help="check a store; --repair keeps every verifiable record"
    )
    check.add_argument("path")
    check.add_argument(
        "--repair",
        action="store_true",
        help="rewrite a damaged manifest keeping every verifiable record (the old one is kept) "
        "and remove interrupted writes; takes each lane's writer lock in turn (a lane being "
        "written is reported and skipped)",
    )
    check.set_defaults(func=cmd_store_fsck)
    out = store_sub.add_parser(
        "export",
        help="write a store in a format training tools read: saelens (cached activations) or "
        "safetensors (vLLM's hidden-state layout); see docs/exports.md",
    )
    out.add_argument("path", help="the store")
    out.add_argument("out", help="the folder to write")
    out.add_argument("--format", required=True, choices=["saelens", "safetensors"])
    out.add_argument("--layer", type=int, help="saelens: the layer whose rows to export")
    out.add_argument("--context-size", type=int, help="saelens: tokens per context (e.g. 128)")
    out.add_argument("--hook-name", help="saelens: the column name (default from the layer)")
    out.add_argument("--packing", choices=["concat", "request"], help="saelens: how contexts fill")
    out.add_argument("--layers", help="safetensors: layers to stack, e.g. 3 or 0,3")
    out.add_argument("--shard-tokens", type=int, help="safetensors: tokens per shard")
    out.add_argument("--dtype", help="safetensors: convert rows, e.g. float32")
    out.add_argument(
        "--phase", choices=["prefill", "decode", "all"], help="which rows (default prefill)"
    )
    out.set_defaults(func=cmd_store_export)
    merge = store_sub.add_parser("compact", help="merge small shards into large ones")
    merge.add_argument("path")
    merge.add_argument(
        "--shard-bytes", type=int, default=1 << 30, help="target shard size (default 1 GiB)"
    )
    merge.set_defaults(func=cmd_store_compact)
    look = sub.add_parser(
        "view", help="write a page of stored requests' or saved responses' tokens and readings"
    )
    look.add_argument(
        "path",
        help="a store, or a JSONL file of server responses (one JSON body per line, sent "
        'with "return_token_ids": true)',
    )
    look.add_argument(
        "--id",
        action="append",
        help="a store id (repeatable; needed for a store), or a response id (default: all)",
    )
    look.add_argument("-o", "--output", required=True, help="the page to write (.html)")
    look.add_argument(
        "--tokenizer",
        help="where the tokenizer is (default: the model the store recorded, or the "
        "responses' model)",
    )
    look.set_defaults(func=cmd_view)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main(sys.argv[1:])
