"""Check, without a GPU and without importing it, that a vLLM release has what probehook uses.

``make compat VLLM=0.33.0`` (or ``python scripts/check_vllm_compat.py 0.33.0``) downloads that
version's wheel with ``pip download --no-deps``, unzips only its ``vllm/**.py`` sources into
``~/.cache/probehook/vllm-src/<version>/`` (the wheel itself is deleted), and checks them with
``ast``. With no version it checks the installed vLLM's sources.

What is checked, and how (the output repeats this):

- **imports**: every ``from vllm... import X`` and ``import vllm...`` in ``probehook/`` (found
  by parsing probehook's own source): the module exists and defines ``X`` at module level (a
  def, class, assignment or import, a submodule, or a lazy ``__getattr__`` export naming it).
- **moved names**: every entry of ``probehook.adapter.vllm_names.MOVED``: found in one of its
  modules; printed where, and "moved" when that is not its 0.32 home.
- **attributes**: :data:`ATTRIBUTES`, a short explicit list of what the adapter reads or
  overrides on vLLM's classes (the V1 runner's batch metadata, the handler methods
  probehook's subclasses override, the private offline methods, ...): defined in the class
  body or its bases (resolved through the modules' imports) as a method, class-level
  assignment or annotation, or ``self.<name> = ...`` in a method.
- **app.state names** the server's install looks up: assigned as ``state.<name> = ...``
  somewhere under ``vllm/entrypoints``.
- **environment variables** and **plugin entry-point groups**: string literals in
  ``vllm/envs.py`` / ``vllm/plugins/__init__.py``.

Not checked: signatures, behaviour (when ``compute_logits`` runs, what a decoder layer
returns), compiled kernels, anything that needs a GPU. Those need a run on that version.
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("PROBEHOOK_CACHE", Path.home() / ".cache" / "probehook"))

# (module, class, attributes): what the adapter reads, calls or overrides on vLLM's classes;
# these cannot be found by parsing probehook's imports.
ATTRIBUTES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    # runner_v1.py / loader.py: the V1 runner's batch metadata and the wrapped entry point
    (
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner",
        (
            "input_batch",
            "requests",
            "query_start_loc",
            "execute_model",
            "get_model",
            "_model_forward",
        ),
    ),
    ("vllm.v1.core.sched.output", "SchedulerOutput", ("finished_req_ids",)),
    # engine_death.py: what the sync client leaves behind when its engine core dies
    (
        "vllm.v1.engine.core_client",
        "SyncMPClient",
        ("outputs_queue", "utility_results", "resources"),
    ),
    ("vllm.v1.engine.core_client", "BackgroundResources", ("engine_dead",)),
    # offline.py: capture() on the pooling runner
    ("vllm.entrypoints.pooling.offline", "PoolingOfflineMixin", ("pooling_task", "encode")),
    ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner", ("input_batch", "requests")),
    (
        "vllm.v1.worker.gpu_input_batch",
        "InputBatch",
        ("num_reqs", "req_ids", "num_computed_tokens_cpu"),
    ),
    (
        "vllm.v1.worker.gpu_input_batch",
        "CachedRequestState",
        ("num_prompt_tokens", "sampling_params", "pooling_params"),
    ),
    # engine_config.py
    (
        "vllm.config.vllm",
        "VllmConfig",
        (
            "use_v2_model_runner",
            "additional_config",
            "model_config",
            "parallel_config",
            "speculative_config",
            "compute_hash",
        ),
    ),
    # offline.py: vLLM's offline request path, private methods included
    (
        "vllm.entrypoints.llm",
        "LLM",
        (
            "_add_request",
            "_render_and_add_requests",
            "_run_engine",
            "_run_tiling_engine",
            "collective_rpc",
            "beam_search",
            "llm_engine",
            "get_tokenizer",
        ),
    ),
    (
        "vllm.v1.engine.llm_engine",
        "LLMEngine",
        (
            "vllm_config",
            "input_processor",
            "output_processor",
            "engine_core",
            "abort_request",
            "has_unfinished_requests",
            "step",
        ),
    ),
    # async_engine.py
    (
        "vllm.v1.engine.async_llm",
        "AsyncLLM",
        (
            "vllm_config",
            "input_processor",
            "engine_core",
            "generate",
            "encode",
            "shutdown",
            "collective_rpc",
            "get_supported_tasks",
            "get_tokenizer",
        ),
    ),
    # serving.py: the methods CaptureCompletionServing / CaptureChatServing override or call
    (
        "vllm.entrypoints.openai.completion.serving",
        "OpenAIServingCompletion",
        (
            "create_completion",
            "completion_stream_generator",
            "request_output_to_completion_response",
            "create_error_response",
            "engine_client",
            "model_config",
        ),
    ),
    (
        "vllm.entrypoints.openai.chat_completion.serving",
        "OpenAIServingChat",
        (
            "create_chat_completion",
            "chat_completion_stream_generator",
            "chat_completion_full_generator",
        ),
    ),
    # pooling_serving.py: the three steps every capture pooling handler wraps
    *(
        (module, cls, ("_init_ctx", "_prepare_generators", "_build_response", "engine_client"))
        for module, cls in (
            ("vllm.entrypoints.pooling.embed.serving", "ServingEmbedding"),
            ("vllm.entrypoints.pooling.classify.serving", "ServingClassification"),
            ("vllm.entrypoints.pooling.pooling.serving", "ServingPooling"),
            ("vllm.entrypoints.pooling.scoring.serving", "ServingScores"),
        )
    ),
    # session.py / capture options
    (
        "vllm.sampling_params",
        "SamplingParams",
        ("extra_args", "skip_reading_prefix_cache", "prompt_logprob_token_ids", "output_kind"),
    ),
    ("vllm.pooling_params", "PoolingParams", ("extra_kwargs", "task")),
)
# server.py / serving.py / pooling_serving.py: the handlers install() looks up on app.state
STATE_NAMES = (
    "openai_serving_completion",
    "openai_serving_chat",
    "serving_embedding",
    "serving_classification",
    "serving_pooling",
    "serving_scores",
)
# handlers only some versions have; install() wraps them when present (refusing the opt-in)
OPTIONAL_STATE_NAMES = ("serving_token_embedding",)
ENV_VARS = (
    "VLLM_USE_V2_MODEL_RUNNER",
    "VLLM_PLUGINS",
    "VLLM_HTTP_TIMEOUT_KEEP_ALIVE",
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION",
)
PLUGIN_GROUPS = ("vllm.general_plugins", "vllm.io_processor_plugins")


# -- vLLM's sources, read with ast ------------------------------------------------------------


class Sources:
    """vLLM's Python sources under one or more roots (each holding a ``vllm/`` package); the
    first root that has a module's file wins (tests overlay a changed copy of one module)."""

    def __init__(self, roots: Sequence[Path]) -> None:
        self.roots = [Path(r) for r in roots]
        self._trees: dict[str, ast.Module | None] = {}

    def path(self, module: str) -> Path | None:
        parts = module.split(".")
        for root in self.roots:
            for candidate in (
                root.joinpath(*parts).with_suffix(".py"),
                root.joinpath(*parts, "__init__.py"),
            ):
                if candidate.is_file():
                    return candidate
        return None

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            path = self.path(module)
            self._trees[module] = ast.parse(path.read_text(), str(path)) if path else None
        return self._trees[module]

    def is_package(self, module: str) -> bool:
        path = self.path(module)
        return path is not None and path.name == "__init__.py"

    def defines(self, module: str, name: str, depth: int = 0) -> str | None:
        """How ``module`` provides ``name`` ("def", "import", "submodule", "lazy", "star"),
        or None."""
        tree = self.tree(module)
        if tree is None or depth > 8:
            return None
        for how, defined in _module_level_names(tree.body):
            if defined == name:
                return how
        for node in _walk_top(tree.body):  # from .x import *: x's public names
            if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
                source = _absolute(module, node, self.is_package(module))
                exported = _all_names(self.tree(source))
                public = (exported is None or name in exported) and not name.startswith("_")
                if public and self.defines(source, name, depth + 1) is not None:
                    return "star"
        if self.is_package(module) and self.path(f"{module}.{name}") is not None:
            return "submodule"
        has_getattr = any(
            isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body
        )
        if has_getattr and any(
            isinstance(n, ast.Constant) and n.value == name for n in ast.walk(tree)
        ):
            return "lazy"  # a module __getattr__ whose table names it
        return None

    def class_def(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.ClassDef] | None:
        """The class ``name`` as seen from ``module`` (following imports): its module and node."""
        tree = self.tree(module)
        if tree is None or depth > 8:
            return None
        for node in _walk_top(tree.body):
            if isinstance(node, ast.ClassDef) and node.name == name:
                return module, node
        for node in _walk_top(tree.body):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        source = _absolute(module, node, self.is_package(module))
                        return self.class_def(source, alias.name, depth + 1)
        return None

    def class_has(self, module: str, cls: str, attr: str, depth: int = 0) -> str | None:
        """Where ``cls`` (or a base class) defines ``attr``: "module.Class", or None."""
        found = self.class_def(module, cls)
        if found is None or depth > 12:
            return None
        where, node = found
        if attr in _class_attributes(node):
            return f"{where}.{node.name}"
        for base in node.bases:
            base_name = _dotted(base)
            if base_name is None:
                continue
            if "." in base_name:  # module.Class through `import module`
                continue
            hit = self.class_has(where, base_name, attr, depth + 1)
            if hit is not None:
                return hit
        return None

    def modules_under(self, package: str) -> Iterator[str]:
        seen: set[str] = set()
        for root in self.roots:
            base = root.joinpath(*package.split("."))
            for path in sorted(base.rglob("*.py")):
                rel = path.relative_to(root).with_suffix("")
                parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
                module = ".".join(parts)
                if module not in seen:
                    seen.add(module)
                    yield module


def _walk_top(body: Iterable[ast.stmt]) -> Iterator[ast.stmt]:
    """Module-level statements, including those inside top-level if/try blocks."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from _walk_top(node.body)
            yield from _walk_top(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody):
                yield from _walk_top(block)
            for handler in node.handlers:
                yield from _walk_top(handler.body)


def _module_level_names(body: Iterable[ast.stmt]) -> Iterator[tuple[str, str]]:
    for node in _walk_top(body):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield "def", node.name
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for name in _target_names(target):
                    yield "def", name
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            yield "def", node.target.id
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield "import", alias.asname or alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                yield "import", alias.asname or alias.name


def _all_names(tree: ast.Module | None) -> set[str] | None:
    """A module's literal ``__all__`` (None: it has none, so every public name)."""
    for node in tree.body if tree else ():
        named_all = isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        )
        if named_all and isinstance(node.value, ast.List | ast.Tuple):
            return {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
    return None


def _target_names(target: ast.expr) -> Iterator[str]:
    if isinstance(target, ast.Name):
        yield target.id
    elif isinstance(target, ast.Tuple | ast.List):
        for element in target.elts:
            yield from _target_names(element)


def _class_attributes(node: ast.ClassDef) -> set[str]:
    names: set[str] = set()
    for item in node.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(item.name)
        elif isinstance(item, ast.Assign):
            for target in item.targets:
                names.update(_target_names(target))
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            names.add(item.target.id)
    for sub in ast.walk(node):  # self.<name> = ... in any method
        targets: list[ast.expr] = []
        if isinstance(sub, ast.Assign):
            targets = list(sub.targets)
        elif isinstance(sub, ast.AnnAssign | ast.AugAssign):
            targets = [sub.target]
        for target in targets:
            if (
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
            ):
                names.add(target.attr)
    return names


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return f"{head}.{node.attr}" if head else None
    if isinstance(node, ast.Subscript):  # Generic[T]
        return _dotted(node.value)
    return None


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    keep = len(parts) - node.level + (1 if is_package else 0)
    base = parts[:keep]
    return ".".join([*base, node.module] if node.module else base)


# -- what probehook uses ------------------------------------------------------------------------


@dataclass
class Use:
    module: str
    name: str | None  # None: `import module`
    where: str  # probehook file:line


def probehook_imports(package: Path = REPO / "probehook") -> list[Use]:
    """Every ``from vllm... import X`` / ``import vllm...`` in probehook's source."""
    uses = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        where = str(path.relative_to(package.parent))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and not node.level:
                module = node.module or ""
                if module == "vllm" or module.startswith("vllm."):
                    for alias in node.names:
                        uses.append(Use(module, alias.name, f"{where}:{node.lineno}"))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "vllm" or alias.name.startswith("vllm."):
                        uses.append(Use(alias.name, None, f"{where}:{node.lineno}"))
    return uses


def moved_table() -> dict:
    sys.path.insert(0, str(REPO))
    try:
        from probehook.adapter.vllm_names import MOVED  # imports no vLLM
    finally:
        sys.path.pop(0)
    return MOVED


# -- the check ---------------------------------------------------------------------------------


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    moved: list[str] = field(default_factory=list)

    def ok(self) -> bool:
        return not self.missing


def check(sources: Sources, uses: Sequence[Use] | None = None, moved: dict | None = None) -> Report:
    """Every check of the module docstring on ``sources``; what is missing and what moved."""
    uses = probehook_imports() if uses is None else uses
    moved = moved_table() if moved is None else moved
    report = Report()
    out = report.lines

    def miss(text: str) -> None:
        report.missing.append(text)
        out.append(f"  MISSING {text}")

    # imports parsed from probehook/
    names = sorted({(u.module, u.name) for u in uses}, key=lambda x: (x[0], x[1] or ""))
    out.append(
        f"[imports] {len(names)} vLLM modules/names imported by probehook/ (found by parsing "
        "its source): module file exists, name defined at module level"
    )
    for module, name in names:
        sites = ", ".join(u.where for u in uses if (u.module, u.name) == (module, name))
        if sources.path(module) is None:
            miss(f"module {module} (imported at {sites})")
        elif name is not None and sources.defines(module, name) is None:
            miss(f"{module}.{name} (imported at {sites})")
    # the moved-names table
    out.append(
        f"[moved names] {len(moved)} names of probehook.adapter.vllm_names.MOVED: found in one "
        "of their modules (newest first)"
    )
    for entry in moved.values():
        home = next((m for m in entry.modules if sources.defines(m, entry.name)), None)
        if home is None:
            if entry.optional:
                out.append(
                    f"  absent  {entry.name} (optional, new in a later vLLM; "
                    f"looked in {', '.join(entry.modules)})"
                )
            else:
                miss(f"{entry.name} (looked in {', '.join(entry.modules)})")
            continue
        oldest = entry.modules[-1]
        if home != oldest:
            report.moved.append(f"{entry.name}: {oldest} -> {home}")
            out.append(f"  moved   {entry.name}: {oldest} -> {home}")
        else:
            out.append(f"  found   {entry.name} in {home}")
    # class attributes (explicit list)
    count = sum(len(attrs) for _, _, attrs in ATTRIBUTES)
    out.append(
        f"[attributes] {count} attributes of {len(ATTRIBUTES)} vLLM classes (explicit list in "
        "this script): defined in the class or a base as a method, class-level name, or "
        "self.<name> = ..."
    )
    for module, cls, attrs in ATTRIBUTES:
        if sources.class_def(module, cls) is None:
            miss(f"class {module}.{cls}")
            continue
        for attr in attrs:
            if sources.class_has(module, cls, attr) is None:
                miss(f"{module}.{cls}.{attr}")
    # app.state handler names
    out.append(
        f"[app.state] {len(STATE_NAMES)} handler names install() looks up: assigned as "
        "state.<name> = ... under vllm/entrypoints"
    )
    assigned = _state_assignments(sources)
    for name in STATE_NAMES:
        if name not in assigned:
            miss(f"app.state.{name}")
    for name in OPTIONAL_STATE_NAMES:
        state = "found" if name in assigned else "absent"
        out.append(f"  {state:7} app.state.{name} (optional; wrapped when present)")
    extra = sorted(n for n in assigned if n.startswith(("serving_", "openai_serving_")))
    new = [n for n in extra if n not in STATE_NAMES + OPTIONAL_STATE_NAMES]
    if new:
        out.append(f"  note    handlers probehook does not wrap itself: {', '.join(new)}")
    # env vars and plugin groups
    out.append(
        f"[strings] {len(ENV_VARS)} environment variables in vllm/envs.py, "
        f"{len(PLUGIN_GROUPS)} plugin groups in vllm/plugins/__init__.py: string literals"
    )
    for module, wanted in (("vllm.envs", ENV_VARS), ("vllm.plugins", PLUGIN_GROUPS)):
        tree = sources.tree(module)
        literals = (
            {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)} if tree else set()
        )
        for value in wanted:
            if value not in literals:
                miss(f"{value!r} in {module}")
    out.append(
        "[not checked] signatures, behaviour (when compute_logits / the pooler run, what a "
        "decoder layer returns), compiled kernels, CUDA: these need a run on that version."
    )
    return report


def _state_assignments(sources: Sources) -> set[str]:
    names: set[str] = set()
    for module in sources.modules_under("vllm.entrypoints"):
        tree = sources.tree(module)
        for node in ast.walk(tree) if tree else ():
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if (
                        isinstance(target, ast.Attribute)
                        and isinstance(target.value, ast.Name)
                        and target.value.id == "state"
                    ):
                        names.add(target.attr)
    return names


# -- getting a version's sources -----------------------------------------------------------------


def fetch_sources(version: str, cache: Path = CACHE) -> Path:
    """``vllm/**.py`` of vLLM ``version``'s wheel under ``cache/vllm-src/<version>`` (a root
    holding ``vllm/``); downloaded once, the wheel deleted after unzipping."""
    root = cache / "vllm-src" / version
    if (root / ".complete").exists():
        return root
    with tempfile.TemporaryDirectory(dir=cache if cache.exists() else None) as tmp:
        print(f"downloading vllm=={version} (no dependencies) ...", file=sys.stderr)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "--quiet",
                f"vllm=={version}",
                "-d",
                tmp,
            ],
            check=True,
        )
        wheels = list(Path(tmp).glob("vllm-*.whl"))
        if len(wheels) != 1:
            raise SystemExit(f"error: expected one vllm wheel in {tmp}, found {wheels}")
        if root.exists():
            shutil.rmtree(root)
        root.mkdir(parents=True)
        with zipfile.ZipFile(wheels[0]) as wheel:
            for member in wheel.namelist():
                if member.startswith("vllm/") and member.endswith(".py"):
                    wheel.extract(member, root)
    (root / ".complete").write_text(version)
    return root


def installed_root() -> Path:
    """The site-packages directory holding the installed ``vllm`` package (not imported)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("error: no vllm is installed here; pass a version, e.g. 0.33.0")
    return Path(next(iter(spec.submodule_search_locations))).parent


def source_version(root: Path) -> str:
    for name in ("_version.py", "version.py"):
        path = root / "vllm" / name
        if path.exists():
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Assign | ast.AnnAssign):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    names = {t.id for t in targets if isinstance(t, ast.Name)}
                    if names & {"__version__", "version"} and isinstance(node.value, ast.Constant):
                        return str(node.value.value)
    return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "version", nargs="?", help="a vLLM release, e.g. 0.33.0 (default: the installed vLLM)"
    )
    parser.add_argument("--cache", type=Path, default=CACHE, help=f"default {CACHE}")
    args = parser.parse_args(argv)
    if args.version:
        args.cache.mkdir(parents=True, exist_ok=True)
        root = fetch_sources(args.version, args.cache)
    else:
        root = installed_root()
    found = source_version(root)
    print(f"vLLM {args.version or 'installed'} sources: {root / 'vllm'} (version {found})")
    report = check(Sources([root]))
    print("\n".join(report.lines))
    if report.moved:
        print(f"moved since 0.32: {'; '.join(report.moved)}")
    if report.ok():
        print(f"OK: everything probehook's adapter uses was found in vLLM {found}.")
        return 0
    print(f"FAILED: {len(report.missing)} missing in vLLM {found} (see MISSING above).")
    return 1


if __name__ == "__main__":
    sys.exit(main())
