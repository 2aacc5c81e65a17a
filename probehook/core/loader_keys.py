"""The names the front end's engine config and the worker's model loader share: the load format
probehook selects and the keys of the capture settings it carries to the workers (in
``model_loader_extra_config`` and ``additional_config``). No imports: both sides read them."""

LOAD_FORMAT = "probehook"
"""The load format probehook.LLM selects; it wraps the user's own load format."""
LOADER_EXTRA_KEY = "probehook_inner_load_format"
"""Key in ``model_loader_extra_config`` naming the user's load format."""
ADDITIONAL_CONFIG_KEY = "probehook"
"""Key in ``additional_config`` holding the engine's CaptureConfig."""
TAP_LAYERS_KEY = "tap_layers"
"""Key in the capture settings: every tapped layer (captured layers plus probes' layers)."""
QUERY_LAYERS_KEY = "query_layers"
"""Key in the capture settings: the layers whose attention op's query is tapped (``attn_q``
readouts; part of the compile-cache key, as the tapped layers are)."""
STEER_LAYERS_KEY = "steer_layers"
"""Key in the capture settings: the layers that get a steering op (part of the compile-cache
key; the vectors are not)."""
EXIT_AFTER_KEY = "exit_after"
"""Key in the capture settings: a capture-only engine's deepest tapped layer, after which the
model stops (part of the compile-cache key; None: every layer runs)."""
WRITES_KEY = "writes"
"""Key in the capture settings: the write table's entries, ``{request option: {instance:
settings}}`` (``probehook.outputs.intervention``), whose layers get their terms (part of the
compile-cache key, as the steered layers are: a graph traced with one instance's term is never
replayed for another's)."""
BANKS_KEY = "probehook_banks"
"""Key in ``model_loader_extra_config``: the engine's banks (probes, first steering vectors,
steering capacity), encoded inline (``probehook.core.bank_file``: no path on the user's
machine, so a worker on another node reads them too), decoded by the loader at model load.
Not part of the compile-cache key (``LoadConfig`` hashes nothing): the banks are read after
the compiled forward, on its taps, whose layers ``TAP_LAYERS_KEY`` names."""
READOUTS_KEY = "probehook_readouts"
"""Key in ``model_loader_extra_config``: the engine's top-k readouts, ``{source: {"k": k,
"instances": {name: settings}}}`` (``probehook.outputs.top_k_readout``), read by the loader
into each readout's bank at model load. Not part of the compile-cache key: they read the taps
after the compiled forward."""
