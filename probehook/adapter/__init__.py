"""The vLLM adapter: the only code that imports vLLM internals, split by process and by the
vLLM surface it touches.

- ``plugin``: the ``vllm.general_plugins`` entry point (every vLLM process);
  ``vllm_names``: vLLM names that moved between versions.
- ``worker/``: in vLLM's worker process: ``loader`` (the model loader, layer location, taps,
  the step hook), ``runner_v1`` (the V1 runner's batch), ``rpc`` (methods mixed into every
  worker), ``monitor_processor`` (the stop monitor's logits processor).
- ``frontend/``: in the user's process: ``offline`` (``probehook.LLM``), ``async_engine``
  (``probehook.AsyncLLM``), ``setup`` and ``engine_config`` (building an engine), ``outputs``,
  ``prompts``, ``io_processor``, ``engine_death``, ``cpu_memory``.
- ``server/``: ``probehook serve`` (``serve``) and its handlers (``serving``,
  ``pooling_serving``).
"""
