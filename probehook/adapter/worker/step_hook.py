"""The once-per-forward step hook of a worker: what it records (its recorders, built from the
readout table at load), the banks allocated at load, and the callbacks the runner patch
calls. No module-level state: it hangs on the model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from probehook.adapter.worker.runner_patch import patch_runner
from probehook.capture_config import CaptureConfig
from probehook.core.bank_file import WorkerBanks
from probehook.worker.readouts import RANK_0, READOUTS, WorkerReadout, readout_row
from probehook.worker.recorder import StepRecorder
from probehook.worker.steering_bank import SteeringBank, StepSteering


class StepHook:
    """Runs the recorder exactly once per forward pass of the runner.

    ``compute_logits`` runs eagerly right after the forward pass, outside torch.compile and
    CUDA graphs, while the runner still holds the step's batch. vLLM also calls it again in
    the same step for each request that asks for ``prompt_logprobs``, and in warm-up: so the
    runner's ``execute_model`` arms the hook and the first ``compute_logits`` after that fires
    it. Nothing fires before :meth:`install_on` (warm-up and profiling are not requests' rows).
    """

    def __init__(
        self,
        buffers: dict[int, torch.Tensor],
        config: CaptureConfig,
        steering: Any = None,
        hidden_size: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ) -> None:
        self.buffers = buffers
        self.device = device if device is not None else torch.device("cpu")
        """The model's device (an engine may tap no layer: steering alone)."""
        self.steering = steering
        """The steering op's buffers (:class:`~probehook.adapter.worker.surgery.SteeringBuffers`;
        None: no layer is steered)."""
        self.hidden_size = hidden_size
        self.dtype = dtype
        """Tap buffer of each tapped layer: ``[max_num_batched_tokens, hidden]``."""
        self.config = config
        self.recording: dict[str, StepRecorder] = {}
        """The recorder of each source this engine records, in the readout table's order
        (built at load by :meth:`allocate_banks`)."""
        self.query_buffers: dict[int, torch.Tensor] = {}
        """Each query-tapped layer's buffer (``attn_q``: the post-RoPE query rows of the
        step, read by readouts at that site)."""
        self.writers: dict[tuple[str, str], Any] = {}
        """The write table's instances' writers, by ``(request option, instance)``
        (:class:`~probehook.worker.write_table.InstanceWriter`)."""
        self.top_k_banks: dict[str, Any] = {}
        """Each top-k readout's bank (SAE features', lenses', the generic
        :class:`~probehook.worker.top_k_bank.TopKBank`), by source, built at load."""
        self.top_k_ranks: dict[str, str] = {}
        """Each top-k readout's ranks (``TopKReadout.ranks``), by source."""
        self.forced_stops = 0
        """Stop tokens this worker's stop processor forced (every rank forces its own: under
        tensor parallelism the ranks' counts agree)."""
        self.steer: StepSteering | None = None
        """The steering bank and its per-step tables (None: no layer is steered)."""
        self.banks: dict[str, Any] = {}
        """What :meth:`allocate_banks` allocated at load, for the start-up report."""
        self.on_step: Callable[[], None] | None = None
        self.before_forward: Callable[[Any], None] | None = None
        self.on_schedule: Callable[[Any], None] | None = None
        self.after_sample: Callable[[torch.Tensor], None] | None = None
        """Called with the step's sampled tokens, after a step whose rows were recorded."""
        self.recorded_step = False
        self.armed = False
        self.steps = 0  # execute_model calls since install_on (for the benchmark)
        self.step_ns = 0  # their wall time
        self.forwards = 0  # of those, the ones the scheduler gave tokens: forward passes
        self.layers_run = 0  # decoder layers the model runs (set at load)
        self.cut: list[str] = []
        """What a capture-only engine does not compute (modules dropped at load)."""

    def allocate_banks(self, banks: WorkerBanks) -> None:
        """Allocate the steering bank and every readout's recorder (the readout table's
        ``build``: probe scores from ``banks``, each top-k readout's from the bank the loader
        built before this), at model load, inside vLLM's memory profiling."""
        rows = [
            *READOUTS.values(),
            *(self.readout_row(source) for source in self.top_k_banks),
        ]
        for readout in rows:
            source = readout.source
            recorder = readout.build(self, banks)
            if recorder is not None:
                recorder.keep_step_rows = readout.read_in_sampler  # monitors read the step's
                self.recording[source] = recorder
        if self.steering is not None:
            steering = self.steering
            bank = SteeringBank(tuple(steering.tables), self.hidden_size, steering.capacity,
                                steering.index.device, tensors=steering.banks)  # fmt: skip
            for name, vectors in banks.vectors.items():
                bank.add(name, vectors)
            self.steer = StepSteering(bank, steering.tables, steering.index)
        self.banks = {
            "probe_outputs": sum(spec.weight.shape[0] for spec in banks.probes),
            "steering_capacity": self.steer.bank.capacity if self.steer is not None else 0,
            "steering_vectors": sorted(banks.vectors) if self.steer is not None else [],
            "readouts": {source: list(bank.slots) for source, bank in self.top_k_banks.items()},
        }

    def readout_row(self, source: str) -> WorkerReadout:
        """The worker's readout-table row of ``source``: a built-in one, or a top-k readout's
        on the ranks it declared (``TopKReadout.ranks``)."""
        return readout_row(source, self.top_k_ranks.get(source, RANK_0))

    def recorders(self) -> list[StepRecorder]:
        """Every recorder this worker has (rows, probe scores, SAE features, ...)."""
        return list(self.recording.values())

    @property
    def recorder(self) -> StepRecorder | None:
        """Hidden-state rows of the captured layers (None when none are captured)."""
        return self.recording.get("hidden")

    @property
    def scorer(self) -> StepRecorder | None:
        """Probe scores (None: no probes)."""
        return self.recording.get("scores")

    def install_on(
        self,
        runner: Any,
        on_step: Callable[[], None],
        before_forward: Callable[[Any], None] | None = None,
        on_schedule: Callable[[Any], None] | None = None,
        after_sample: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        """Patch ``runner`` so that ``on_step`` records once per forward pass;
        ``before_forward`` (steering) is called with the step's scheduler output after the
        runner prepared the batch, right before the model runs; ``on_schedule`` with every
        scheduler output, forward pass or not (one with no tokens may still finish
        requests). Installed once: a second call only replaces the callbacks."""
        self.before_forward = before_forward
        self.on_schedule = on_schedule
        self.after_sample = after_sample
        if self.on_step is not None:
            self.on_step = on_step
            return
        self.on_step = on_step
        patch_runner(runner, self)

    def fire(self) -> None:
        """Called by the model's ``compute_logits``, or by its pooler for pooling models."""
        if self.armed and self.on_step is not None:
            self.armed = False
            self.recorded_step = True  # the sampling that follows may record too
            self.on_step()
