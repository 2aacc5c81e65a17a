"""CaptureSession.tag on its own (no engine): what per-request options it accepts; and the
fill algorithm (probehook.frontend.fill) on fake outputs, offline and streamed."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator

import pytest
import torch

from probehook.capture_config import CaptureConfig
from probehook.core.export_wire import BatchReport, ExportReply, SpanReport
from probehook.errors import CaptureConfigError, CaptureError
from probehook.frontend import fill
from probehook.frontend.request_stream import RequestStream
from probehook.frontend.session import CaptureSession
from probehook.frontend.sources import engine_sources
from probehook.frontend.tracked_request import TrackedRequest
from probehook.outputs.top_k_readout import pack


class Params:
    """The fields of vLLM's SamplingParams that tag reads."""

    def __init__(self, **extra: object) -> None:
        self.n = 1
        self.extra_args = {"probehook": extra} if extra else None
        self.prompt_logprob_token_ids = None
        self.stop_token_ids = None


def session() -> CaptureSession:
    config = CaptureConfig(layers=(0, 3), include_prefill=False, include_decode=True)
    return CaptureSession(config, rpc=lambda method, args: [], abort=lambda ids: None)


@pytest.mark.parametrize("off", [False, [], None])
def test_switching_probes_off_is_fine_on_an_engine_without_probes(off: object) -> None:
    tagged = session().tag(Params(probes=off, layers=[3]))
    assert tagged.extra_args["probehook"]["layers"] == [3]


def test_asking_for_probes_on_an_engine_without_probes_is_an_error() -> None:
    with pytest.raises(CaptureConfigError, match="engine has no probes"):
        session().tag(Params(probes=["truth"]))
    with pytest.raises(CaptureConfigError, match="engine has no probes"):
        session().tag(Params(monitors=[{"probe": "truth", "threshold": 0.5}]))


def test_asking_for_nothing_leaves_the_request_untagged() -> None:
    tagged = session().tag(Params(layers=[], probes=False, include_prefill=False))
    assert "tag" not in tagged.extra_args["probehook"]


def test_tagged_params_copy_cheaply_and_keep_the_users_values_apart() -> None:
    """vLLM deep-copies a request's params several times: probehook's wire (and extra args
    holding nothing else) are shared by the copies; the user's other extra args are copied.
    Requests of one template name it, so the worker reads it once."""
    import copy

    one = session()
    tagged = [one.tag(Params()), one.tag(Params())]
    for params in tagged:
        clone = copy.deepcopy(params)
        assert clone.extra_args is params.extra_args
    first, second = (p.extra_args["probehook"] for p in tagged)
    assert first["tag"] != second["tag"] and first["plan"] == second["plan"]
    assert one.tag(Params(), stream=True).extra_args["probehook"]["plan"] != first["plan"]
    mine = Params()
    mine.extra_args = {"mine": [1, 2]}
    own = one.tag(mine)
    clone = copy.deepcopy(own)
    assert clone.extra_args is not own.extra_args
    assert (
        clone.extra_args["mine"] == [1, 2]
        and clone.extra_args["mine"] is not own.extra_args["mine"]
    )
    assert clone.extra_args["probehook"] is own.extra_args["probehook"]


# -- probehook.frontend.fill: one algorithm for offline and streamed outputs ----------------


class Completion:
    def __init__(self, index: int, token_ids: list[int]) -> None:
        self.index = index
        self.token_ids = token_ids
        self.text = ""
        self.finish_reason = None
        self.stop_reason = None


class Output:
    def __init__(self, completions: list[Completion], finished: bool = False) -> None:
        self.request_id = "r"
        self.prompt_token_ids = [1, 2, 3, 4]
        self.outputs = completions
        self.finished = finished


class Rows:
    """A fake stream receiver: row ``p`` of every stream holds ``p`` in every column."""

    def __init__(self, fail: str | None = None) -> None:
        self.asked: list[tuple[str, str, int, int]] = []
        self.fail = fail

    async def take(self, source: str, key: str, lo: int, hi: int) -> torch.Tensor:
        from probehook.core.stream_frames import StreamFailed

        self.asked.append((source, key, lo, hi))
        if self.fail == key:
            raise StreamFailed(f"Capture of stream {key} failed: over the limit")
        return torch.arange(lo, hi, dtype=torch.float32)[None, :, None].expand(2, -1, 8).clone()


def tracked(include_prefill: bool = True) -> TrackedRequest:
    config = CaptureConfig(layers=(0, 3), include_prefill=include_prefill, include_decode=True)
    return TrackedRequest("T", "", config, {})


def stream(kind: str, receiver: Rows) -> RequestStream:
    capture = session()
    capture.row_format = (8, torch.float32)
    return RequestStream(capture, receiver, tracked(), kind)  # type: ignore[arg-type]


def test_offline_plan_asks_for_the_whole_request() -> None:
    output = Output([Completion(0, [7, 8, 9])], finished=True)
    planned = fill.plan(output, tracked(), engine_sources())
    assert list(planned.needs()) == [
        fill.Need("hidden", "T/0", 0, 4),  # the prompt
        fill.Need("hidden", "T/0", 3, 6),  # decode row i: position 3 + i
    ]


def test_a_delta_stream_gets_each_row_once_and_the_whole_for_the_store() -> None:
    receiver = Rows()
    delta = stream("delta", receiver)
    first, second = Output([Completion(0, [7, 8])]), Output([Completion(0, [9])], finished=True)
    asyncio.run(delta.fill(first))
    asyncio.run(delta.fill(second))
    assert first.prefill_hidden_states[3][:, 0].tolist() == [0, 1, 2, 3]
    assert first.outputs[0].hidden_states[0][:, 0].tolist() == [3, 4]
    assert second.prefill_hidden_states[3].shape == (0, 8)  # prompt rows went out already
    assert second.outputs[0].hidden_states[0][:, 0].tolist() == [5]
    assert second.hidden_states is second.outputs[0].hidden_states
    # A cumulative stream's output holds every row to date, as offline.
    cumulative = stream("cumulative", Rows())
    whole = Output([Completion(0, [7, 8, 9])], finished=True)
    asyncio.run(cumulative.fill(whole))
    assert whole.outputs[0].hidden_states[3][:, 0].tolist() == [3, 4, 5]


def test_a_cumulative_output_that_grows_while_its_rows_are_awaited_gets_rows_for_every_token() -> (
    None
):
    """vLLM grows a cumulative output's token list in place; its output handler can append a
    token while the stream awaits the rows of the earlier ones (seen once in the suite: a
    yield with 4 tokens and 3 rows). The rows must match the tokens the output holds."""

    class Growing(Rows):
        def __init__(self, output: Output) -> None:
            super().__init__()
            self.output, self.grown = output, False

        async def take(self, source: str, key: str, lo: int, hi: int) -> torch.Tensor:
            rows = await super().take(source, key, lo, hi)
            if not self.grown:  # the next token arrives meanwhile
                self.output.outputs[0].token_ids.append(10)
                self.grown = True
            return rows

    output = Output([Completion(0, [7, 8])])
    asyncio.run(stream("cumulative", Growing(output)).fill(output))
    assert len(output.outputs[0].token_ids) == 3
    assert output.outputs[0].hidden_states[0][:, 0].tolist() == [3, 4, 5]
    assert output.outputs[0].hidden_states[3][:, 0].tolist() == [3, 4, 5]


def test_a_failed_stream_fails_its_slots_and_names_the_reason() -> None:
    failing = stream("cumulative", Rows(fail="T/0"))
    output = Output([Completion(0, [7])], finished=True)
    asyncio.run(failing.fill(output))
    completion = output.outputs[0]
    assert isinstance(completion.hidden_states, fill.FailedCapture)
    assert isinstance(output.prefill_hidden_states, fill.FailedCapture)
    assert "over the limit" in completion.capture_error
    with pytest.raises(CaptureError, match="over the limit"):
        completion.hidden_states[0]


class Pooled:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.prompt_token_ids = [1, 2, 3]
        self.outputs = None
        self.finished = True


def test_offline_fill_asks_one_export_for_every_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """Generation outputs: their spans per stream; pooled outputs: one batch per source."""
    from probehook.frontend import session as session_module

    asked: list[tuple] = []
    rows = torch.arange(10, dtype=torch.float32)[None, :, None].expand(2, -1, 8).clone()

    def rpc(method: str, args: tuple) -> list:
        asked.append(args)
        _, requests, *batches = args
        spans = [
            SpanReport(r["key"], r["source"], lo, hi, tensor_index=0)
            for r in requests
            for lo, hi in r["spans"]
        ]
        reports = [BatchReport(0) for _ in (batches[0] if batches else [])]
        failures = {"hidden:T1/0": "over the limit"}
        return [ExportReply("x", [1], spans, failures, reports).to_wire()]

    capture = CaptureSession(tracked().config, rpc=rpc, abort=lambda ids: None)
    monkeypatch.setattr(capture.spool, "owns", lambda path: True)
    monkeypatch.setattr(session_module, "read_tensors", lambda path, entries: [rows])
    generated = Output([Completion(0, [7, 8])], finished=True)
    pooled = [Pooled("p0"), Pooled("p1")]
    capture.pending = {"r": tracked(), "p0": dataclasses.replace(tracked(), tag="T0")}
    capture.pending["p1"] = dataclasses.replace(tracked(), tag="T1")
    capture.fill([generated, *pooled])
    ((_, requests, batches),) = asked
    assert [(r["key"], r["spans"]) for r in requests] == [("T/0", [[0, 4], [3, 5]])]
    assert batches == [
        {"source": "hidden", "layers": [0, 3], "keys": ["T0/0", "T1/0"], "spans": [0, 3, 0, 3]}
    ]
    assert generated.outputs[0].hidden_states[3].shape == (10, 8)
    assert pooled[0].hidden_states[0][:, 0].tolist() == [0, 1, 2]  # its part of the batch
    assert isinstance(pooled[1].prefill_hidden_states, fill.FailedCapture)
    assert "over the limit" in pooled[1].capture_error


def test_a_stream_stores_on_its_store_thread_while_the_event_loop_goes_on() -> None:
    """A server's store waits on the disk (backpressure when its writer falls behind, the
    first fsync of a run): the add runs on the engine's store thread, and every other stream
    on the event loop goes on meanwhile (issue 37, item 2)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    released = threading.Event()
    threads: list[str] = []

    class SlowDisk:
        def add(self, pending: object) -> str:
            threads.append(threading.current_thread().name)
            assert released.wait(10), "the event loop never got to release the disk"
            return "run-r"

    async def scenario() -> list[int]:
        ticks: list[int] = []
        stored = stream("cumulative", Rows())
        stored.session.store = SlowDisk()
        stored.request.sampling = {}
        stored.store_thread = ThreadPoolExecutor(1, thread_name_prefix="store")
        output = Output([Completion(0, [7, 8])], finished=True)
        filling = asyncio.ensure_future(stored.fill(output))
        for tick in range(3):  # the loop runs while the add waits on the "disk"
            await asyncio.sleep(0.01)
            ticks.append(tick)
        released.set()
        await filling
        stored.store_thread.shutdown()
        assert output.store_id == "run-r"
        return ticks

    assert asyncio.run(scenario()) == [0, 1, 2]
    assert threads and threads[0].startswith("store")


def test_the_export_messages_round_trip() -> None:
    """Each export message reads back what it wrote (the one definition both sides use)."""
    from probehook.core.export_wire import BatchAsk, StreamAsk

    ask = StreamAsk("T/0", "scores", ["scores"], [[0, 4], [4, 6]], final=False)
    assert StreamAsk.from_wire(ask.to_wire()) == ask
    batch = BatchAsk("hidden", [0, 3], ["A/0", "B/0"], [0, 3, 1, 5])
    assert BatchAsk.from_wire(batch.to_wire()) == batch and batch.pairs() == [(0, 3), (1, 5)]
    reply = ExportReply(
        "p",
        [{"shape": [2, 3]}],
        [SpanReport("T/0", "hidden", 0, 4, 0, 1, [2])],
        {"scores:U/0": "over the limit"},
        [BatchReport(1, [(0, 2, [5, 6])])],
    )
    assert ExportReply.from_wire(reply.to_wire()) == reply


@pytest.mark.parametrize(
    "attribute", ["prefill_sae_features", "sae_features", "hidden_states", "probe_scores"]
)
def test_a_failed_capture_of_any_readout_is_a_failed_capture(attribute: str) -> None:
    """A request whose SAE features (or any readout's values) failed is failed, in outputs and
    in the store: ``store_filled`` keeps none of it (issue 43: SAE failures were stored as
    if the request had no features)."""
    from probehook.outputs.shapes import failed
    from probehook.store.records import store_filled

    output = Output([Completion(0, [7])], finished=True)
    output.request_id = "r"
    fill.clear_outputs(output)
    assert not failed(output)
    target = output if attribute.startswith("prefill_") else output.outputs[0]
    setattr(target, attribute, fill.FailedCapture("the worker lost it"))
    assert failed(output)

    class Store:
        def add(self, pending: object) -> str:
            raise AssertionError("a failed request was stored")

    store_filled(Store(), output, tracked())
    assert output.store_id is None


# -- SAE features on streams: each row decoded once, monitors at the engine's k -------------

ENGINE_K = 4


class PackedRows:
    """A fake receiver of one SAE's packed rows (engine k = 4), held as the real receiver
    holds them (one growing buffer, views handed out). Position ``p``'s features are
    ``p, p+1, p+2, p+3`` with values ``4, 3, 2, 1``, so feature ``f`` is third (rank 2, out of
    a request's top 2) at position ``f - 2``."""

    def __init__(self) -> None:
        from probehook.frontend.stream_receiver import StreamRows

        self.rows = StreamRows()

    async def take(self, source: str, key: str, lo: int, hi: int) -> torch.Tensor:
        assert source == "sae", source
        while self.rows.hi < hi:
            p = max(self.rows.hi, 0)
            packed = pack(torch.tensor([[p, p + 1, p + 2, p + 3]]),
                          torch.tensor([[4.0, 3.0, 2.0, 1.0]]), torch.tensor([4.0]))  # fmt: skip
            self.rows.add(p, packed[None])
        return self.rows.take(lo, hi)


def sae_stream(kind: str, monitors: tuple = (), k: int = 2) -> RequestStream:
    """A stream of SAE ``s``'s features (the SAE readout, as the session's source has it; its
    engine k is 4), the request keeping ``k``."""
    from probehook.frontend.readout_set import ReadoutSet, RequestReadout
    from probehook.frontend.sources import TopKReadoutRows
    from probehook.saes.readout import SAEReadout

    saes = object.__new__(ReadoutSet)  # the engine's instances, without reading SAE folders
    saes.readout, saes.source, saes.k = SAEReadout(), "sae", 4
    saes.instances = {"s": {"layer": 0, "d_sae": 16}}
    capture = session()
    capture.sources["sae"] = TopKReadoutRows(saes)
    config = CaptureConfig(layers=(), include_prefill=True, include_decode=True)
    asked = {"sae": RequestReadout(("s",), k, monitors)}
    request = TrackedRequest("T", "", config, {}, readouts=asked)
    return RequestStream(capture, PackedRows(), request, kind)  # type: ignore[arg-type]


def test_a_cumulative_sae_stream_decodes_each_row_once_and_hands_out_views(monkeypatch) -> None:
    """Every yield of a cumulative stream holds every feature row to date; the rows a yield
    converts (and the rows its flag monitor reads) do not grow with the tokens before it
    (issue 43: both were O(T) per yield, O(T^2) per stream)."""
    from probehook.outputs.top_k import TopKRows
    from probehook.saes.readout import FeatureMonitor

    read = []
    value_of = TopKRows.value_of
    monkeypatch.setattr(
        TopKRows,
        "value_of",
        lambda self, i, outside=0.0: read.append(len(self)) or value_of(self, i, outside),
    )
    flag = FeatureMonitor("s", 9, 1.5, action="flag")
    streaming = sae_stream("cumulative", (flag,))
    output, converted = Output([Completion(0, [])]), []
    for token in range(300):
        output.outputs[0].token_ids.append(token)
        before = streaming.decoded[("sae", "T/0")].converted if streaming.decoded else 0
        asyncio.run(streaming.fill(output))
        converted.append(streaming.decoded[("sae", "T/0")].converted - before)
    features = output.outputs[0].sae_features["s"]
    assert len(features) == 300 and features.k == 2
    assert features.indices[:, 0].tolist() == list(range(3, 303))  # decode row i: position 3+i
    assert len(output.prefill_sae_features["s"]) == 4
    assert converted[0] == 4 and set(converted[1:]) == {1}, converted[:5]  # one new row each
    assert max(read[1:]) == 1, "the flag monitor read earlier rows again"
    # The values are views of the receiver's buffer, not copies.
    buffer = streaming.receiver.rows._buf
    assert features.values.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    # Feature 9 is 2.0, third, at position 7 (decode row 4): out of the request's top 2, in
    # the engine's top 4, which the monitor watches (as the worker does); then 3.0 and 4.0.
    assert output.outputs[0].feature_flags == {"s:9": [4, 5, 6]}
    assert features.activation(9)[4] == 0 and features.watched.activation(9)[4] == 2.0


def test_two_flag_monitors_on_one_feature_flag_their_union_offline_and_streamed() -> None:
    """Two flag monitors on one feature share its key in ``feature_flags``: it holds the union
    of their rows, offline and in a cumulative stream alike (review D3: the last monitor's rows
    overwrote the first's, and the stream's second monitor started from the first's state)."""
    from probehook.saes.readout import FeatureMonitor

    # Feature 9 is 1.0, 2.0, 3.0, 4.0 on decode rows 3..6 and 0 (outside the top 4) elsewhere.
    high = FeatureMonitor("s", 9, 2.5, action="flag")  # rows 5, 6
    low = FeatureMonitor("s", 9, 1.5, action="flag", direction="below")  # 0..3 and 7..
    want = [0, 1, 2, 3, 5, 6, 7, 8]
    offline = sae_stream("final", (high, low))
    output = Output([Completion(0, list(range(9)))], finished=True)
    asyncio.run(offline.fill(output))
    assert output.outputs[0].feature_flags == {"s:9": want}
    streaming = sae_stream("cumulative", (high, low))
    output = Output([Completion(0, [])])
    for token in range(9):
        output.outputs[0].token_ids.append(token)
        asyncio.run(streaming.fill(output))
    assert output.outputs[0].feature_flags == {"s:9": want}


def test_a_feature_stop_below_the_requests_k_names_its_reason() -> None:
    """The worker stops on the engine's k; the front end names the stop from the same values
    (issue 43: a request's smaller sae_top_k hid the feature, so no stop reason and no
    flags). "below": a feature outside the engine's top-k reads 0."""
    from probehook.saes.readout import FeatureMonitor

    stop = FeatureMonitor("s", 9, 1.5, action="stop")
    offline = sae_stream("final", (stop,))
    offline.request.stop_token = 2
    output = Output([Completion(0, [5, 6, 7, 8, 2])], finished=True)
    output.outputs[0].finish_reason = "stop"
    asyncio.run(offline.fill(output))
    assert output.outputs[0].stop_reason == "feature:s:9"
    below = FeatureMonitor("s", 9, 0.5, action="flag", direction="below")
    flags = sae_stream("final", (below,))
    output = Output([Completion(0, [5, 6, 7, 8, 2, 3])], finished=True)
    asyncio.run(flags.fill(output))
    # Decode row i is position 3 + i; feature 9 is in the top 4 at positions 6..9 (rows 3..6).
    assert output.outputs[0].feature_flags == {"s:9": [0, 1, 2]}


@pytest.fixture
def row_scale() -> Iterator[object]:
    """The toy intervention (tests/toy_intervention.py), registered in this process."""
    from toy_intervention import RowScale

    from probehook.outputs import OUTPUT_PROCESSORS

    list(OUTPUT_PROCESSORS)
    OUTPUT_PROCESSORS.register(RowScale)
    yield RowScale()
    OUTPUT_PROCESSORS.unregister(RowScale.name)


def test_a_write_option_on_an_engine_without_it_names_the_engine_option(row_scale) -> None:
    with pytest.raises(CaptureConfigError, match=r"sets scale, but the engine was built without it"
                       r".*build it with scale_layers=\.\.\. \(row_scale\)"):  # fmt: skip
        session().tag(Params(scale=0.5))
    with pytest.raises(CaptureConfigError, match=r"Unknown probehook option\(s\) 'scales'"):
        session().tag(Params(scales=0.5))
    from probehook.saes import SAEError  # SAE clamping: the same path, the SAEs' error class

    with pytest.raises(SAEError, match=r"sets clamp, but the engine was built without it .*"
                       r"build it with sae_clamping=\.\.\. \(sae_clamp\)"):  # fmt: skip
        session().tag(Params(clamp={"s": {"1": 0.0}}))


def test_write_terms_are_checked_salted_and_carried_on_the_wire(row_scale) -> None:
    from probehook.frontend.write_set import WriteSet

    config = CaptureConfig(layers=(0, 3), include_prefill=False, include_decode=True)
    writes = {"scale": WriteSet(row_scale, {"L1": {"layer": 1, "site": "resid_pre"},
                                            "L2": {"layer": 2, "site": "resid_pre"}})}  # fmt: skip
    capture = CaptureSession(config, rpc=lambda method, args: [], abort=lambda ids: None,
                             writes=writes)  # fmt: skip
    every = capture.tag(Params(scale=0.5))
    assert every.extra_args["probehook"]["writes"] == {"scale": {"L1": 0.5, "L2": 0.5}}
    # equal asks, equal salts (the canonical terms); other terms, another salt; none, none
    same = capture.tag(Params(scale={"L2": 0.5, "L1": 0.5}))
    other = capture.tag(Params(scale={"L1": 0.5}))
    assert capture.cache_salt(every) == capture.cache_salt(same) != capture.cache_salt(other)
    assert capture.cache_salt(other) is not None
    assert capture.cache_salt(capture.tag(Params(layers=[3]))) is None
    with pytest.raises(CaptureConfigError, match=r"scale\['L1'\]=inf is not finite"):
        capture.tag(Params(scale={"L1": float("inf")}))
    described = capture.describe(every)
    assert described is not None and described.writes == {"scale": {"L1": 0.5, "L2": 0.5}}
