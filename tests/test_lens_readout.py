"""The lens readout's parts without an engine: the worker's bank on a stand-in head (top-k
log-probs and the target's against a hand computation, tiling, the rows a request asked for),
the request options, the rows' forms (JSON, base64, streams). The engine and Hugging Face
comparisons are in test_capture_under_load.py, test_engine_options.py, test_capture_only.py
and test_multi_engine.py (TP=2)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_same_top_k

from probehook.errors import CaptureConfigError
from probehook.outputs.lens import LensReadout, LensRows
from probehook.outputs.top_k import TopKDecoder, carried_indices, compact_top_k
from probehook.outputs.top_k_readout import pack
from probehook.worker import lens_bank
from probehook.worker.lens_bank import LensBank

HIDDEN, VOCAB = 8, 11


def _head() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(HIDDEN, VOCAB, bias=False)


def _logit_instances(*layers: int) -> dict:
    return {
        f"logit@{layer}": {"layer": layer, "lens": "logit", "kind": "logit", "path": None,
                           "num_layers": 4}
        for layer in layers
    }  # fmt: skip


def test_bank_reads_top_k_and_target_log_probs_like_a_hand_computation() -> None:
    head = _head()
    bank = LensBank(_logit_instances(1), 3, head)
    rows = torch.randn(5, HIDDEN)
    nxt = torch.tensor([4, 0, 10, -1, 7])  # -1: not known
    with torch.no_grad():
        out = bank([rows], None, nxt)
        expected = torch.log_softmax(head(rows), dim=1)
    assert out.shape == (1, 5, 7)
    got = LensRows.unpack(out[0], 3)
    top = expected.topk(3, dim=1)  # over 5 rows; the bank reads them in tiles
    assert_same_top_k(got.token_ids, got.logprobs, top.indices, top.values)
    known = nxt >= 0
    torch.testing.assert_close(
        got.target_logprob[known], expected[known].gather(1, nxt[known, None])[:, 0]
    )
    assert torch.isnan(got.target_logprob[~known]).all()


def test_bank_tiles_rows_and_reads_only_the_rows_asked(monkeypatch) -> None:
    head = _head()
    monkeypatch.setattr(lens_bank, "LOGITS_TILE_BYTES", 4 * VOCAB * 2)  # two rows a tile
    bank = LensBank(_logit_instances(1, 2), 2, head)
    layer1, layer2 = torch.randn(7, HIDDEN), torch.randn(7, HIDDEN)
    nxt = torch.arange(7) % VOCAB
    asked = [np.array([0, 2, 3, 6]), np.array([], dtype=np.int64)]
    with torch.no_grad():
        out = bank([layer1, layer2], asked, nxt)
        full = LensBank(_logit_instances(1), 2, head)([layer1], None, nxt)
    torch.testing.assert_close(out[0, asked[0]], full[0, asked[0]])
    ids = carried_indices(out[..., :2])  # the padding, as the int32 bits the rows carry
    assert (ids[0, [1, 4, 5]] == -1).all() and (ids[1] == -1).all()


@pytest.mark.parametrize("by_rows", [False, True])
def test_targets_drawn_after_the_read_are_filled_by_complete(by_rows: bool) -> None:
    """The bank reads before sampling: rows whose next token is not known yet (-1) keep
    their log-sum-exp, and ``complete`` fills their targets (from ``token_logits`` where the
    model gives one, else the head's column) equal to a read that knew the tokens."""
    head = _head()

    def token_logits(rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return head(rows).gather(1, ids[:, None])[:, 0] if by_rows else None  # type: ignore[return-value]

    bank = LensBank(_logit_instances(1, 2), 3, head, token_logits if by_rows else None)
    layer1, layer2 = torch.randn(6, HIDDEN), torch.randn(6, HIDDEN)
    drawn = torch.tensor([3, 9, 0, 5, 11, 2])
    before = torch.tensor([3, -1, 0, -1, 11, -1])  # rows 1, 3, 5: their requests' newest
    asked = [np.array([0, 1, 3, 5]), np.array([1, 2])]
    with torch.no_grad():
        out = bank([layer1, layer2], asked, before)
        assert torch.isnan(out[0, [1, 3, 5], 6]).all() and torch.isnan(out[1, 1, 6])
        bank.complete(out, lambda rows: drawn[torch.from_numpy(rows)])
        knew = LensBank(_logit_instances(1, 2), 3, head)([layer1, layer2], asked, drawn)
    for slot, rows in enumerate(asked):
        torch.testing.assert_close(out[slot, rows], knew[slot, rows])
    bank.complete(out, None)  # nothing pending: a no-op
    with torch.no_grad():
        again = bank([layer1, layer2], asked, before)
    bank.complete(again, None)  # never sampled: the targets stay NaN
    assert torch.isnan(again[0, [1, 3, 5], 6]).all()


def test_ranks_holding_vocabulary_shards_merge_to_the_whole_reading() -> None:
    """Tensor parallelism: two ranks (threads here, in step as vLLM's workers are) each hold
    half of a padded vocabulary; one all-gather per read merges their top-k lists,
    log-sum-exps and targets, and ``complete`` their sampled tokens' logits: both ranks end
    with the reading of one rank that holds it all."""
    import threading
    from types import SimpleNamespace

    head = _head()  # VOCAB = 11 tokens, padded to 12: rank 1 holds 6..10 and one padding
    width, ranks = 6, 2
    barrier = threading.Barrier(ranks)
    posted: dict[int, torch.Tensor] = {}

    def shard_of(rank: int) -> SimpleNamespace:
        start = rank * width

        def logits(rows: torch.Tensor) -> torch.Tensor:
            out = torch.full((rows.shape[0], width), float("-inf"))
            held = min(width, VOCAB - start)
            out[:, :held] = head(rows)[:, start : start + held]
            return out

        def token_logits(rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            mine = (ids >= start) & (ids < min(start + width, VOCAB))
            return torch.where(mine, head(rows).gather(1, ids[:, None])[:, 0], float("-inf"))

        def all_gather(part: torch.Tensor) -> torch.Tensor:
            posted[rank] = part
            barrier.wait()
            whole = torch.cat([posted[r] for r in range(ranks)], dim=-1)
            barrier.wait()
            return whole

        parts = dict(logits=logits, token_logits=token_logits, all_gather=all_gather)
        return SimpleNamespace(**parts, start=start, vocab=VOCAB, ranks=ranks)

    rows = torch.randn(5, HIDDEN)
    before = torch.tensor([4, -1, 10, 0, -1])
    drawn = torch.tensor([4, 9, 10, 0, 2])
    got: dict[int, torch.Tensor] = {}

    def run(rank: int) -> None:
        bank = LensBank(_logit_instances(1), 3, head, shard=shard_of(rank))
        with torch.no_grad():
            out = bank([rows], None, before)
            bank.complete(out, lambda picked: drawn[torch.from_numpy(picked)])
        got[rank] = out

    threads = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    with torch.no_grad():
        whole = LensBank(_logit_instances(1), 3, head)([rows], None, drawn)
    for rank in range(ranks):
        torch.testing.assert_close(got[rank], whole)


def test_lens_dtype_sets_the_maps_dtype(tmp_path) -> None:
    """``lens_dtype="bfloat16"``: a J-lens's map runs in bfloat16 (the reading moves by
    bfloat16's rounding, no more); the engine option is checked."""
    from helpers import write_random_lenses

    files = write_random_lenses(tmp_path, HIDDEN, 4)
    head = _head()

    def j(dtype: str | None) -> dict:
        return {"j@1": {"layer": 1, "lens": "j", "kind": "jacobian", "path": files["j"],
                        "num_layers": 4, "dtype": dtype}}  # fmt: skip

    rows, nxt = torch.randn(6, HIDDEN), torch.arange(6)
    with torch.no_grad():
        full = LensBank(j(None), 3, head)([rows], None, nxt)
        half = LensBank(j("bfloat16"), 3, head)([rows], None, nxt)
    assert not torch.equal(full, half)
    torch.testing.assert_close(half[0, :, 3:], full[0, :, 3:], atol=0.05, rtol=0)
    with pytest.raises(CaptureConfigError, match="lens_dtype='int8' is not valid"):
        LensReadout().instances({"l": "logit"}, {"lens_layers": [1], "lens_dtype": "int8"},
                                num_layers=4, hidden_size=HIDDEN)  # fmt: skip


def test_requests_pick_lenses_and_layers() -> None:
    readout = LensReadout()
    instances = {
        **_logit_instances(1, 3),
        "j@1": {"layer": 1, "lens": "j", "kind": "jacobian", "path": "x", "num_layers": 4},
        "j@3": {"layer": 3, "lens": "j", "kind": "jacobian", "path": "x", "num_layers": 4},
    }
    assert readout.pickable(instances) == ["logit", "j"]
    assert readout.narrow(["j"], {"lens_layers": (3,)}, instances) == ["j@3"]
    assert readout.narrow(["logit", "j"], {}, instances) == ["logit@1", "logit@3", "j@1", "j@3"]
    with pytest.raises(CaptureConfigError, match=r"layer\(s\) \[2\].*lens_layers: \[1, 3\]"):
        readout.narrow(["j"], {"lens_layers": (2,)}, instances)
    with pytest.raises(CaptureConfigError, match="not a layer index"):
        readout.narrow(["j"], {"lens_layers": ("two",)}, instances)
    # As the engine option reads them (review D7): negative from the end, "all" (every layer
    # the engine reads), and a bare int is that layer.
    assert readout.narrow(["j"], {"lens_layers": [-1]}, instances) == ["j@3"]
    assert readout.narrow(["j"], {"lens_layers": "all"}, instances) == ["j@1", "j@3"]
    assert readout.narrow(["j"], {"lens_layers": 1}, instances) == ["j@1"]
    with pytest.raises(CaptureConfigError, match="pass a list of layer indices"):
        readout.narrow(["j"], {"lens_layers": False}, instances)


def test_a_requests_lens_layers_0_is_layer_0_not_every_layer() -> None:
    """``{"lens_layers": 0}`` reaches the readout as layer 0 (review D7: ``0 == False`` dropped
    it, so the request got every layer)."""
    from probehook.core.request_options import RequestOptions

    options = {"lenses": "lens", "lens_layers": "lens"}  # the picking option first
    parsed = RequestOptions.from_user({"lens_layers": 0}, options)
    assert parsed.readout_extras == (("lens", "lens_layers", 0),)


def test_engine_options_are_checked() -> None:
    readout = LensReadout()
    with pytest.raises(CaptureConfigError, match="needs lens_layers"):
        readout.instances({"l": "logit"}, {}, num_layers=4, hidden_size=HIDDEN)
    with pytest.raises(CaptureConfigError, match="no layer 9"):
        readout.instances({"l": "logit"}, {"lens_layers": [9]}, num_layers=4, hidden_size=HIDDEN)
    with pytest.raises(CaptureConfigError, match="without '@'"):
        readout.instances({"a@b": "logit"}, {"lens_layers": [1]}, num_layers=4, hidden_size=8)
    with pytest.raises(CaptureConfigError, match="unknown lens option"):
        readout.instances({"l": "logit"}, {"lens_layer": [1]}, num_layers=4, hidden_size=8)
    got = readout.instances({"l": "logit"}, {"lens_layers": "all"}, num_layers=4, hidden_size=8)
    assert sorted(got) == ["l@0", "l@1", "l@2", "l@3"]


def test_lens_monitors_are_checked_against_the_engine_and_travel_on_the_wire() -> None:
    from probehook import LensMonitor
    from probehook.capture_config import CaptureConfig
    from probehook.core.monitors import top_k_value
    from probehook.core.request_options import RequestOptions, RequestWire
    from probehook.frontend.readout_set import ReadoutSet

    for bad, words in [
        (dict(layer="3"), "layer='3' is not valid"),
        (dict(token="!"), "pass a token id"),
        (dict(token=-1), "negative"),
        (dict(action="steer"), "choose one of"),
        (dict(threshold=float("nan")), "finite number"),
    ]:
        with pytest.raises(CaptureConfigError, match=words):
            LensMonitor(**{"lens": "l", "layer": 3, "token": 4, "threshold": -1.0, **bad})

    def engine(k: int, *monitors: LensMonitor) -> ReadoutSet:
        extras = {"lens_layers": [1, 3]}
        return ReadoutSet(LensReadout(), {"l": "logit"}, k, num_layers=4, hidden_size=HIDDEN,
                          extras=extras, monitors=monitors, vocab_size=VOCAB)  # fmt: skip

    with pytest.raises(CaptureConfigError, match=r"raise lens_top_k to 21 or more"):
        engine(5, LensMonitor("l", 3, 4, -3.0))  # a token outside the top 5 may be 1/21 likely
    with pytest.raises(CaptureConfigError, match=r"pass a threshold above -4\.17"):
        engine(5, LensMonitor("l", 3, 4, -5.0))  # past the largest k
    with pytest.raises(CaptureConfigError, match=r"watches 'l@2'.*\['l@1', 'l@3'\]"):
        engine(5, LensMonitor("l", 2, 4, -1.0))
    with pytest.raises(CaptureConfigError, match="not a token id of this model"):
        engine(5, LensMonitor("l", 3, VOCAB, -1.0))
    watched = LensMonitor("l", 3, 4, -1.0, action="stop")
    lenses = engine(20, watched)  # -3.0 is above -log(21): allowed at k=20
    assert engine(20, LensMonitor("l", 3, 4, -3.0)).monitors[0].threshold == -3.0
    assert lenses.for_request(None).monitors == (watched,)  # the engine's
    assert lenses.for_request(None, {"lens_layers": [1]}).monitors == ()  # not read
    own = RequestOptions.from_user(
        {"monitors": [{"lens": "l", "layer": 1, "token": 2, "threshold": -0.5}]}
    ).monitors
    assert lenses.for_request(None, {}, own).monitors == own  # a request's own replace them
    with pytest.raises(CaptureConfigError, match=r"watch \['l@1'\].*ask for them too"):
        lenses.for_request(None, {"lens_layers": [3]}, own)
    with pytest.raises(CaptureConfigError, match="a LensMonitor has fields"):
        RequestOptions.from_user({"monitors": [{"lens": "l", "layer": 1, "threshold": -0.5}]})
    wire = RequestWire("t", CaptureConfig(layers=()), readouts=(("lens", ("l@3",)),),
                       readout_monitors=((watched, lenses.slot("l@3")),))  # fmt: skip
    assert RequestWire.from_wire(wire.to_wire()) == wire
    # The value a monitor reads: the token's log-prob among the k, -inf outside.
    # ids 4, 7 (as the int32 bits packed rows carry); log-probs; target
    both = pack(torch.tensor([[4, 7], [7, 4]]), torch.tensor([[-0.2, -1.9], [-0.3, -1.2]]),
                torch.tensor([-2.5, -2.5]), LensRows)  # fmt: skip
    packed = both[0].numpy()
    assert top_k_value(packed, 7, watched.outside) == pytest.approx(-1.9)
    assert top_k_value(packed, 5, watched.outside) == float("-inf")
    rows = LensRows.unpack(both, 2)
    assert rows.value_of(4, -np.inf).tolist() == pytest.approx([-0.2, -1.2])
    # A request that keeps 1: monitors read the engine's k, its rows show 1.
    assert rows.top(1).watched.value_of(7, -np.inf).tolist() == pytest.approx([-1.9, -0.3])
    assert rows.top(1).value_of(7, -np.inf).tolist() == pytest.approx([-np.inf, -0.3])


def test_rows_are_presented_by_lens_and_layer_and_flattened_back() -> None:
    readout = LensReadout()
    rows = LensRows.empty(2)
    value = readout.present({"j@1": rows, "j@3": rows, "logit@1": rows})
    assert value == {"j": {1: rows, 3: rows}, "logit": {1: rows}}
    assert readout.flat(value) == {"j@1": rows, "j@3": rows, "logit@1": rows}


def test_json_and_base64_forms_name_the_lens_columns_and_write_nan_as_null() -> None:
    packed = pack(torch.tensor([[3, 1], [2, 0]]), torch.tensor([[-0.5, -1.5], [-0.1, -2.0]]),
                  torch.tensor([-2.25, float("nan")]), LensRows)  # fmt: skip
    rows = LensRows.unpack(packed, 2)
    assert rows.target_logprob.dtype == torch.float32
    assert rows.to_dict() == {
        "token_ids": [[3, 1], [2, 0]],
        "logprobs": [[-0.5, -1.5], [-0.10000000149011612, -2.0]],
        "target_logprob": [-2.25, None],
    }
    response = LensReadout().to_response({"j": {1: rows}})
    assert response["j"]["1"]["target_logprob"] == [-2.25, None]
    compact = LensReadout().to_compact({"j": {1: rows}})["j"]["1"]
    # the NaN target is named as non-finite values are (review D12)
    assert sorted(compact) == ["logprobs", "non_finite", "target_logprob", "token_ids"]
    assert compact["non_finite"] == response["j"]["1"]["non_finite"] == [1]
    assert compact == compact_top_k({"j@1": rows})["j@1"]


def test_a_cumulative_stream_decodes_lens_rows_once_with_float_targets() -> None:
    decoder = TopKDecoder(LensRows)
    row = pack(torch.tensor([[1, 0]]), torch.tensor([[-0.5, -1.0]]), torch.tensor([-0.25]),
               LensRows)  # fmt: skip
    buffer = row.repeat(6, 1)[None]  # [slots, n, 2k + 1]
    first = decoder.decode(buffer[:, :2], 0)[0]
    later = decoder.decode(buffer[:, :6], 0)[0]
    assert isinstance(later, LensRows) and len(first) == 2 and len(later) == 6
    assert later.target_logprob.tolist() == [-0.25] * 6
    assert decoder.converted == 6


@pytest.mark.parametrize("compact", [False, True])
def test_served_readings_carry_each_tokens_text_beside_its_id(compact: bool) -> None:
    """The server's choice field writes each entry's text (its ``TokenText``) beside the ids,
    in the JSON and the base64 forms; other readouts' fields get none."""
    from types import SimpleNamespace

    from probehook.frontend.response_fields import ChoiceFields, TokenText
    from probehook.saes.readout import SAEReadout as SAEFeatureSets

    class Tokenizer:
        calls = 0

        def decode(self, ids: list[int]) -> str:
            Tokenizer.calls += 1
            return f"<{ids[0]}>"

    one = pack(torch.tensor([[3, 1]]), torch.tensor([[-0.5, -1.5]]), torch.tensor([-2.25]),
               LensRows)  # fmt: skip
    rows = LensRows.unpack(one.repeat(2, 1), 2)
    fields = ChoiceFields([LensReadout(), SAEFeatureSets()], compact, TokenText(Tokenizer()))
    completion = SimpleNamespace(index=0, lens={"j": {1: rows}}, sae_features={"s": rows})
    fields.add(0, SimpleNamespace(), completion)
    field = fields.take(0)
    assert field["lens"]["j"]["1"]["tokens"] == [["<3>", "<1>"], ["<3>", "<1>"]]
    assert "tokens" not in field["sae_features"]["s"]
    assert Tokenizer.calls == 2  # each id decoded once
    without = ChoiceFields([LensReadout()], compact)
    without.add(0, SimpleNamespace(), completion)
    assert "tokens" not in without.take(0)["lens"]["j"]["1"]


def test_a_request_keeps_fewer_entries_than_the_engine_and_the_wire_carries_it() -> None:
    """A readout's per-request k (``lens_top_k``, generic ``<request option>_top_k``): at most
    the engine's, carried on the wire so the front end cuts the engine's rows to it."""
    from probehook.capture_config import CaptureConfig
    from probehook.core.request_options import RequestOptions, RequestWire
    from probehook.frontend.readout_set import ReadoutSet

    engine = ReadoutSet(LensReadout(), {"l": "logit"}, 5, num_layers=4, hidden_size=HIDDEN,
                        extras={"lens_layers": [1, 3]})  # fmt: skip
    assert engine.request_options == ("lenses", "lens_top_k", "lens_layers")
    assert engine.for_request(None, {"lens_top_k": 2}).k == 2
    assert engine.for_request(None, {}).k == 5
    for bad in (0, 6, True, "2"):
        with pytest.raises(CaptureConfigError, match=r"lens_top_k=.* is not valid: .* 1\.\.5"):
            engine.for_request(None, {"lens_top_k": bad})
    options = dict.fromkeys(engine.request_options, "lens")
    parsed = RequestOptions.from_user({"lens_top_k": 2}, options)
    assert parsed.readout_extras == (("lens", "lens_top_k", 2),)
    wire = RequestWire("t", CaptureConfig(layers=()), readouts=(("lens", ("l@1",)),),
                       readout_top_k=(("lens", 2),))  # fmt: skip
    assert wire.to_wire()["readout_top_k"] == {"lens": 2}
    assert RequestWire.from_wire(wire.to_wire()) == wire
    with pytest.raises(CaptureConfigError, match="readout_top_k"):
        RequestWire.from_wire({**wire.to_wire(), "readout_top_k": {"lens": 0}})
