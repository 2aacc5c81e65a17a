"""probehook.AsyncLLM: streamed outputs carry the rows and scores of the tokens they hold.

The reference is the offline ``probehook.LLM`` with the same capture on the same weights (its
rows equal Hugging Face's, see test_capture_parity.py): the session's shared ``reference_llm``
(tests/conftest.py), also the server tests' reference, idle while the AsyncLLM runs. The
AsyncLLM lives on one event loop for the whole module, as in a notebook or an ``asyncio.run``
script.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import first_record, random_probes

# The topology set's AsyncLLM (tests/README.md): the module's engine has its engine core and
# worker in their own processes, as a user's has.
pytestmark = [pytest.mark.engine, pytest.mark.topology]
ENGINE = dict(dtype="float32", max_model_len=256, gpu_memory_utilization=0.1, seed=0)
CAPTURE = dict(layers=[0, 3], include_prefill=True, enforce_eager=True)
TOL = 1e-4  # float32 rows of one eager engine in batches of other shapes
SAE_TOP_K = 8


def prompts(n: int) -> list[str]:
    return [f"{i}+{(5 * i) % 40}=" * (1 + i % 3) for i in range(n)]


def greedy(max_tokens: int = 16, **kwargs: Any) -> Any:
    from probehook import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kwargs)


@pytest.fixture(scope="module")
def offline(reference_llm: Any) -> dict[str, Any]:
    """Solo offline runs of every prompt the tests stream, by prompt, on the shared reference
    engine (the same capture as ``CAPTURE`` and the same probes)."""
    outs = [reference_llm.generate([p], greedy(), use_tqdm=False)[0] for p in prompts(8)]
    return {out.prompt: out for out in outs}


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    # End it as asyncio.run ends its loop. An engine shut down from outside the loop cancels
    # its output handler by a callback this loop has not run yet: closed as it is, the task
    # stays pending until a later garbage collection destroys it, in whatever test is running
    # then (one such finaliser broke sae_lens's import in test_store_export).
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.run_until_complete(loop.shutdown_asyncgens())
    assert not asyncio.all_tasks(loop), "a task outlived its cancellation"
    loop.close()


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("async") / "store"


@pytest.fixture(scope="module")
def sae_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A jumprelu SAE on layer 3, saved by SAELens (read by the worker process's loader)."""
    from sae_oracle import make_saelens_sae

    folder = tmp_path_factory.mktemp("sae") / "res3"
    return make_saelens_sae("jumprelu", folder, 128, 256, "blocks.3.hook_resid_post", seed=4)


@pytest.fixture(scope="module")
def engine(
    llama_dir: Path,
    offline: dict,
    loop: asyncio.AbstractEventLoop,
    store_dir: Path,
    sae_dir: Path,
) -> Iterator[Any]:
    from engine_layout import users_layout

    from probehook import AsyncLLM

    with users_layout():
        engine = AsyncLLM(
            str(llama_dir),
            probes=random_probes(128),
            store=store_dir,
            steering_layers=[0],  # vectors come later (add_steering)
            saes={"res3": sae_dir},
            sae_top_k=SAE_TOP_K,
            **CAPTURE,
            **ENGINE,
        )
    yield engine
    engine.shutdown()


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool((a.float() - b.float()).abs().max() <= TOL)


def assert_same_as_offline(final: Any, reference: Any) -> None:
    got, ref = final.outputs[0], reference.outputs[0]
    assert list(got.token_ids) == list(ref.token_ids)
    for layer in (0, 3):
        assert close(got.hidden_states[layer], ref.hidden_states[layer]), layer
        assert close(final.prefill_hidden_states[layer], reference.prefill_hidden_states[layer])
    for name in ref.probe_scores:
        assert close(got.probe_scores[name], ref.probe_scores[name]), name
        assert close(final.prefill_probe_scores[name], reference.prefill_probe_scores[name])
    assert final.hidden_states is got.hidden_states and final.probe_scores is got.probe_scores


async def settled(engine: Any, keys: tuple[str, ...], timeout: float = 30.0) -> dict:
    """``engine.stats()`` once the counters ``keys`` are all 0, or at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await engine.stats()
        if all(stats[k] == 0 for k in keys) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.05)


async def collect(engine: Any, prompt: str, params: Any, request_id: str | None = None) -> list:
    """The outputs, each with what it held when it was yielded (vLLM grows the token list of
    a cumulative output in place, so it must be read at once)."""
    outs = []
    async for out in engine.generate(prompt, params, request_id):
        out.tokens_then = len(out.outputs[0].token_ids)
        outs.append(out)
    return outs


def test_banks_come_at_load_inline(engine, loop) -> None:
    """The worker allocated the probe, steering and SAE banks at model load, from the banks
    the front end encoded into the engine's config: no file on the user's machine, which a
    worker on another node could not read (issue 43)."""
    from helpers import random_probes

    from probehook.core.bank_file import WorkerBanks
    from probehook.core.loader_keys import BANKS_KEY

    banks = engine._plan.banks
    assert engine.vllm_config.load_config.model_loader_extra_config[BANKS_KEY] == banks
    assert len(WorkerBanks.decode(banks).probes) == len(random_probes(128))
    loop.run_until_complete(engine.start_capture())
    outputs = sum(int(p.weight.shape[0]) for p in random_probes(128).values())
    assert engine.capture_info["banks"] == {
        "probe_outputs": outputs,
        "steering_capacity": 64,
        "steering_vectors": [],
        "readouts": {"sae": ["res3"]},
    }


def test_each_output_kind_carries_the_rows_of_its_tokens(engine, offline, loop, store_dir) -> None:
    from vllm.sampling_params import RequestOutputKind as Kind

    from probehook import ActivationStore

    prompt = prompts(8)[1]
    reference = offline[prompt]

    async def main() -> tuple[list, list, list]:
        return await asyncio.gather(
            collect(engine, prompt, greedy(output_kind=Kind.CUMULATIVE)),
            collect(engine, prompt, greedy(output_kind=Kind.DELTA)),
            collect(engine, prompt, greedy(output_kind=Kind.FINAL_ONLY)),
        )

    cumulative, delta, final_only = loop.run_until_complete(main())
    assert len(cumulative) > 1 and len(delta) > 1 and len(final_only) == 1
    for out in cumulative:  # row i belongs to token i, in the same yield
        n = out.tokens_then
        assert out.outputs[0].hidden_states[3].shape[0] == n
        assert out.outputs[0].probe_scores["truth"].shape[0] == n
    prompt_len = len(reference.prompt_token_ids)
    for i, out in enumerate(delta):
        n = out.tokens_then
        assert out.outputs[0].hidden_states[0].shape[0] == n
        for layer in (0, 3):  # prefill rows once, first; later yields keep the layer, 0 rows
            rows = out.prefill_hidden_states[layer]
            assert rows.shape == (prompt_len if i == 0 else 0, 128), (i, rows.shape)
    assert_same_as_offline(cumulative[-1], reference)
    assert_same_as_offline(final_only[0], reference)
    joined = {
        layer: torch.cat([o.outputs[0].hidden_states[layer] for o in delta]) for layer in (0, 3)
    }
    assert all(close(joined[layer], reference.outputs[0].hidden_states[layer]) for layer in joined)
    scores = torch.cat([o.outputs[0].probe_scores["size"] for o in delta])
    assert close(scores, reference.outputs[0].probe_scores["size"])

    # Each kind's request is stored whole (a delta stream's too), and reads back as offline.
    engine.store.flush()
    store = ActivationStore.open(store_dir)
    for final in (cumulative[-1], delta[-1], final_only[0]):
        stored = store[final.store_id]
        assert stored.output_token_ids == list(reference.outputs[0].token_ids)
        assert close(stored.hidden_states[3], reference.outputs[0].hidden_states[3])
        assert close(stored.prefill_hidden_states[0], reference.prefill_hidden_states[0])
        assert close(stored.probe_scores["truth"], reference.outputs[0].probe_scores["truth"])


def test_64_streams_with_random_aborts_leave_nothing_behind(engine, offline, loop) -> None:
    chosen = random.Random(0)
    batch = [prompts(8)[i % 8] for i in range(64)]
    aborted_at = {i: chosen.randint(1, 10) for i in chosen.sample(range(64), 16)}

    async def stream(i: int) -> tuple[int, Any]:
        last = None
        aborted = False
        async for out in engine.generate(batch[i], greedy(), f"load-{i}"):
            last = out
            # >=: a lagging consumer may see several new tokens in one output.
            if not aborted and len(out.outputs[0].token_ids) >= aborted_at.get(i, 99):
                await engine.abort(f"load-{i}")
                aborted = True
        return i, last

    async def main() -> list:
        return await asyncio.gather(*(stream(i) for i in range(64)))

    results = loop.run_until_complete(main())
    for i, last in results:
        if i in aborted_at:
            # An abort that reaches the engine after the last token ends nothing: a consumer
            # that lags (a loaded machine) may ask once the request has finished. Otherwise
            # the stream ends aborted.
            completed = len(last.outputs[0].token_ids) == greedy().max_tokens
            assert last.outputs[0].finish_reason == "abort" or completed, last.outputs[0]
            n = len(last.outputs[0].token_ids)
            assert last.outputs[0].hidden_states[0].shape[0] == n  # what it got is complete
        else:
            assert_same_as_offline(last, offline[batch[i]])
    # The engine steps past the aborted requests after their streams end: poll its counters.
    keys = ("pending_requests", "pending_streams", "retained_bytes")
    keys += ("front_end_streams", "front_end_requests")
    stats = loop.run_until_complete(settled(engine, keys))
    assert {k: stats[k] for k in keys} == dict.fromkeys(keys, 0)


def test_sae_features_stream_with_their_tokens(engine, loop, llama_dir, sae_dir) -> None:
    """Every yield carries the features of its own tokens (delta) or of all to date
    (cumulative); the streams join to what SAELens reads on HF's rows; a request that asks a
    smaller k or no SAEs gets that; the store keeps the whole delta stream's features."""
    from sae_oracle import assert_features_match, assert_output_features, oracle
    from vllm.sampling_params import RequestOutputKind as Kind

    from probehook import ActivationStore
    from probehook.testing import hf_residual_stream

    prompt = prompts(8)[2]

    async def main() -> tuple[list, list, list, list]:
        return await asyncio.gather(
            collect(engine, prompt, greedy(output_kind=Kind.CUMULATIVE)),
            collect(engine, prompt, greedy(output_kind=Kind.DELTA)),
            collect(engine, prompt, greedy(extra_args={"probehook": {"sae_top_k": 3}})),
            collect(engine, prompt, greedy(extra_args={"probehook": {"saes": False}})),
        )

    cumulative, delta, small, off = loop.run_until_complete(main())
    for out in cumulative:
        assert out.outputs[0].sae_features["res3"].indices.shape == (out.tokens_then, SAE_TOP_K)
    for i, out in enumerate(delta):
        assert len(out.outputs[0].sae_features["res3"]) == out.tokens_then
        assert len(out.prefill_sae_features["res3"]) == (len(out.prompt_token_ids) if i == 0 else 0)
    final = cumulative[-1]
    lens = {"res3": oracle(sae_dir)}
    assert_output_features(final, llama_dir, lens, {"res3": 3}, ["res3"], SAE_TOP_K)
    # The delta stream's pieces join to its whole: SAELens on HF's rows of its tokens (the two
    # streams ran in other batches, so their float32 values may differ in the last bits).
    joined = [o.outputs[0].sae_features["res3"] for o in delta]
    whole = [torch.cat([getattr(f, part) for f in joined]) for part in ("indices", "values", "l0")]
    tokens = list(delta[0].prompt_token_ids) + [t for o in delta for t in o.outputs[0].token_ids]
    p = len(delta[0].prompt_token_ids)
    rows = hf_residual_stream(llama_dir, tokens)[3, p - 1 : p - 1 + len(whole[2])]
    assert len(whole[2]) == len(tokens) - p
    assert_features_match(*whole, lens["res3"], rows, SAE_TOP_K)
    assert_output_features(small[-1], llama_dir, lens, {"res3": 3}, ["res3"], 3)
    assert off[-1].sae_features == {} and off[-1].prefill_sae_features == {}
    engine.store.flush()
    stored = ActivationStore.open(engine.store.root)[delta[-1].store_id]
    assert torch.equal(stored.sae_features["res3"].indices, whole[0])


def test_an_aborted_delta_stream_keeps_its_shape(engine, offline, loop) -> None:
    """Every yield carries every asked layer and probe, with 0 rows when it holds no new
    tokens: the abort's last output (0 new tokens) included, so a loop that concatenates
    per yield never meets a missing key."""
    from vllm.sampling_params import RequestOutputKind as Kind

    prompt = prompts(8)[4]
    reference = offline[prompt]

    async def stream() -> list:
        outs = []
        async for out in engine.generate(prompt, greedy(output_kind=Kind.DELTA), "shape"):
            out.tokens_then = len(out.outputs[0].token_ids)
            outs.append(out)
            if len(outs) == 3:
                await engine.abort("shape")
        return outs

    outs = loop.run_until_complete(stream())
    last = outs[-1]
    assert last.outputs[0].finish_reason == "abort" and last.tokens_then == 0
    names = list(reference.outputs[0].probe_scores)
    for out in outs:
        got = out.outputs[0]
        assert list(got.hidden_states) == [0, 3] and list(out.prefill_hidden_states) == [0, 3]
        assert list(got.probe_scores) == names and list(out.prefill_probe_scores) == names
        assert got.hidden_states[3].shape == (out.tokens_then, 128)
        assert out.hidden_states is got.hidden_states
    assert last.prefill_hidden_states[0].shape == (0, 128)
    assert last.outputs[0].probe_scores["truth"].shape == (0,)
    joined = torch.cat([o.outputs[0].hidden_states[3] for o in outs])
    n = joined.shape[0]
    assert n == sum(o.tokens_then for o in outs) and n > 0
    assert close(joined, reference.outputs[0].hidden_states[3][:n])
    scores = torch.cat([o.outputs[0].probe_scores["topic"] for o in outs])
    assert close(scores, reference.outputs[0].probe_scores["topic"][:n])


def test_stop_monitor_ends_a_stream_with_the_probe_named(engine, offline, loop) -> None:
    prompt = prompts(8)[2]
    k, threshold, direction = first_record(offline[prompt].outputs[0].probe_scores["size"])
    monitor = {"probe": "size", "threshold": threshold, "action": "stop", "direction": direction}
    params = greedy(extra_args={"probehook": {"monitors": [monitor]}})
    outs = loop.run_until_complete(collect(engine, prompt, params))
    final = outs[-1].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == "probe:size"
    assert len(final.token_ids) == k + 1  # rows 0..k-1 did not cross; token k is the EOS


def test_a_stream_may_ask_for_a_subset_of_layers_and_probes(engine, offline, loop) -> None:
    prompt = prompts(8)[3]
    reference = offline[prompt]
    params = greedy(extra_args={"probehook": {"layers": [3], "probes": ["topic"]}})
    final = loop.run_until_complete(collect(engine, prompt, params))[-1]
    got = final.outputs[0]
    assert list(got.hidden_states) == [3] and list(final.prefill_hidden_states) == [3]
    assert close(got.hidden_states[3], reference.outputs[0].hidden_states[3])
    assert close(final.prefill_hidden_states[3], reference.prefill_hidden_states[3])
    assert list(got.probe_scores) == ["topic"]
    assert close(got.probe_scores["topic"], reference.outputs[0].probe_scores["topic"])


def test_steered_streams_and_the_bank_while_serving(engine, offline, loop) -> None:
    """add_steering on a running AsyncLLM, then a steered delta stream: its prompt rows after
    layer 0 are the unsteered ones plus the vector; a request that captures nothing is
    steered alike; after remove_steering the name is refused."""
    from vllm.sampling_params import RequestOutputKind as Kind

    from probehook import CaptureConfigError, SteeringVector

    prompt = prompts(8)[4]
    reference = offline[prompt]
    direction = torch.randn(128, generator=torch.Generator().manual_seed(11))
    up = SteeringVector({0: direction / direction.norm() * 5.0})
    steer = {"probehook": {"steer": {"up": 2.0}}}
    quiet = {"probehook": {"steer": {"up": 2.0}, "layers": [], "probes": False}}

    async def main() -> tuple[list, list]:
        await engine.add_steering("up", up)
        return await asyncio.gather(
            collect(engine, prompt, greedy(output_kind=Kind.DELTA, extra_args=steer)),
            collect(engine, prompt, greedy(extra_args=quiet)),
        )

    delta, uncaptured = loop.run_until_complete(main())
    assert engine.steering_info()["vectors"]["up"]["layers"] == [0]
    v = 2.0 * up.vector(0)
    first = delta[0]
    assert close(first.prefill_hidden_states[0], reference.prefill_hidden_states[0] + v)
    assert close(first.outputs[0].hidden_states[0][0], reference.outputs[0].hidden_states[0][0] + v)
    for out in delta:
        assert out.outputs[0].steering == {"vectors": {"up": 2.0}, "phase": "both", "start": 0}
    tokens = [t for out in delta for t in out.outputs[0].token_ids]
    assert tokens != list(reference.outputs[0].token_ids)
    final = uncaptured[-1].outputs[0]
    assert list(final.token_ids) == tokens and final.hidden_states == {}
    assert final.steering["vectors"] == {"up": 2.0}

    async def in_flight() -> None:
        stream = engine.generate(prompt, greedy(extra_args=steer))
        await stream.__anext__()
        with pytest.raises(CaptureConfigError, match=r"'up' is named by 1 request\(s\) in"):
            await engine.remove_steering("up")
        async for _ in stream:
            pass

    loop.run_until_complete(in_flight())

    async def removed() -> None:
        await engine.remove_steering("up")
        await collect(engine, prompt, greedy(extra_args=steer))

    with pytest.raises(CaptureConfigError, match=r"\['up'\].*its vectors are \[\]"):
        loop.run_until_complete(removed())


def test_request_id_is_optional(engine, loop) -> None:
    outs = loop.run_until_complete(collect(engine, prompts(1)[0], greedy(2)))
    assert outs[-1].request_id and outs[-1].finished
    assert outs[-1].outputs[0].hidden_states[0].shape[0] == 2


def test_bad_per_request_options_fail_before_generation(engine, loop) -> None:
    from probehook.errors import CaptureConfigError

    bad = greedy(2, extra_args={"probehook": {"probes": ["lies"]}})
    with pytest.raises(CaptureConfigError, match=r"not engine probes; valid names"):
        loop.run_until_complete(collect(engine, "1+1=", bad))
    with pytest.raises(CaptureConfigError, match=r"layers"):
        loop.run_until_complete(
            collect(engine, "1+1=", greedy(2, extra_args={"probehook": {"layers": [7]}}))
        )
    stats = loop.run_until_complete(engine.stats())
    assert stats["front_end_requests"] == 0 and stats["pending_streams"] == 0


def test_malformed_options_storm(engine, offline, loop) -> None:
    """Every malformed option object is refused with the words of the one parser (the same
    as the offline LLM's), all of them sent at once; the engine then streams a normal request
    exactly as the offline reference."""
    from malformed_options import malformed
    from vllm.exceptions import VLLMValidationError

    from probehook.core.request_options import RequestOptions
    from probehook.errors import CaptureConfigError

    wanted, params = [], []
    for value in malformed():
        try:
            params.append(greedy(2, extra_args={"probehook": value}))
        except VLLMValidationError:
            continue  # vLLM's SamplingParams refuses it itself (an int over 64 bits)
        with pytest.raises(CaptureConfigError) as err:
            RequestOptions.from_user(
                value, engine.session.readout_options, engine.session.write_options
            )
        wanted.append(str(err.value))
    assert len(params) >= 100

    async def storm() -> list:
        return await asyncio.gather(
            *(collect(engine, "1+1=", p) for p in params), return_exceptions=True
        )

    for got, want in zip(loop.run_until_complete(storm()), wanted, strict=True):
        assert isinstance(got, CaptureConfigError) and str(got) == want, (got, want)
    prompt = prompts(1)[0]
    outs = loop.run_until_complete(collect(engine, prompt, greedy()))
    assert_same_as_offline(outs[-1], offline[prompt])
    stats = loop.run_until_complete(engine.stats())
    assert stats["front_end_requests"] == 0 and stats["pending_streams"] == 0


def test_from_engine_args_without_capture_is_plain_vllm(llama_dir, engine, loop) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs

    from probehook import AsyncLLM

    async def main() -> list:
        args = AsyncEngineArgs(model=str(llama_dir), enforce_eager=True, **ENGINE)
        plain = AsyncLLM.from_engine_args(args)
        try:
            assert plain.session is None
            return await collect(plain, prompts(1)[0], greedy(3))
        finally:
            plain.shutdown()

    final = loop.run_until_complete(main())[-1]
    assert len(final.outputs[0].token_ids) == 3
    assert final.hidden_states == {} and final.probe_scores == {} and final.store_id is None


def test_front_end_believes_v1_and_beam_search_is_refused(engine, loop, monkeypatch) -> None:
    """The front end of a capturing AsyncLLM answers V1 for its life, as its workers run, and
    BeamSearchParams are refused before they reach the engine."""
    import os

    from vllm.sampling_params import BeamSearchParams

    from probehook.adapter.frontend.engine_config import RUNNER_ENV
    from probehook.errors import CaptureConfigError

    assert RUNNER_ENV not in os.environ  # the process's setting, restored after construction
    assert engine.input_processor.vllm_config is engine.vllm_config  # request-time checks
    monkeypatch.setenv(RUNNER_ENV, "1")  # on a GPU, Triton makes an unset variable mean V2
    assert engine.vllm_config.use_v2_model_runner is False
    monkeypatch.delenv(RUNNER_ENV)
    beam = BeamSearchParams(beam_width=2, max_tokens=2)
    with pytest.raises(CaptureConfigError, match="Beam search is not supported on a capturing"):
        loop.run_until_complete(collect(engine, "1+1=", beam))


def test_uncaptured_requests_leave_the_workers_tables_bounded(engine, loop) -> None:
    """A server captures only the requests that opt in, and an ``AsyncLLM`` never calls the
    export RPC that used to prune the worker's per-request table: every request it ran left
    an entry there (issue 37, item 3; 10,000 here before the fix). Bounded now by the
    engine's requests, whatever the number run."""
    from probehook.worker.recorder import DEPARTED_SLACK

    max_num_seqs = engine.vllm_config.scheduler_config.max_num_seqs
    # four times the bound below per recorder: an unbounded table would hold every request
    requests = 4 * (2 * max_num_seqs + DEPARTED_SLACK)

    async def main() -> tuple[dict, dict]:
        before = await engine.stats()
        engine.capture_unmarked = False  # the server's setting
        try:
            gate = asyncio.Semaphore(512)  # a bounded client

            async def one(i: int) -> None:
                async with gate:
                    async for _ in engine.generate(f"{i % 97}+1=", greedy(1)):
                        pass

            await asyncio.gather(*(one(i) for i in range(requests)))
        finally:
            engine.capture_unmarked = True
        return before, await engine.stats()

    before, after = loop.run_until_complete(main())
    # Three recorders: rows, probe scores, SAE features.
    assert after["tracked_requests"] <= 3 * (2 * max_num_seqs + DEPARTED_SLACK), (before, after)
    assert after["steering_states"] <= max_num_seqs
    assert after["pending_requests"] == before["pending_requests"]


def test_shutdown_commits_what_was_stored(engine, loop, store_dir) -> None:
    """Requests stored since the last flush are committed by shutdown, with no flush by the
    user. It shuts the module's engine down, so it is the module's last test (a test after it
    would meet a stopped engine); the fixture's own shutdown then does nothing."""
    from probehook import ActivationStore

    final = loop.run_until_complete(collect(engine, prompts(8)[5], greedy(4)))[-1]
    assert final.store_id is not None and engine.store.unflushed > 0
    engine.shutdown()  # outside the loop, which stays open and idle
    # vLLM's sockets are closed, so its ZeroMQ context can end: left open, whichever thread
    # garbage-collects the context later blocks forever (it hung this suite once).
    context = engine.engine_core.resources.ctx
    ended = threading.Thread(target=context.term, daemon=True)
    ended.start()
    ended.join(timeout=20)
    assert not ended.is_alive(), "vLLM's ZeroMQ context still has open sockets after shutdown"
    stored = ActivationStore.open(store_dir)[final.store_id]
    assert stored.output_token_ids == list(final.outputs[0].token_ids)
    for layer in (0, 3):
        assert close(stored.hidden_states[layer], final.outputs[0].hidden_states[layer])
