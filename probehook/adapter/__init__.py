"""The vLLM adapter: the only code that imports vLLM internals, split by the surface it touches.

- ``plugin``: the ``vllm.general_plugins`` entry point (every vLLM process).
- ``loader``: the ``probehook`` model loader, layer location, taps and the step hook.
- ``runner_v1``: reading the V1 model runner's batch after each forward pass.
- ``worker``: the RPC surface mixed into every worker (``worker_extension_cls``).
- ``engine_config``: construction-time checks on vLLM's resolved config, runner selection and
  the engine arguments that switch capture on.
- ``outputs``: vLLM's output classes with probehook's attributes.
- ``offline``: ``probehook.LLM``, vLLM's offline front end around a ``CaptureSession``.
"""
