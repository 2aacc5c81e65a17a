"""The per-request wire format (probehook.core.request_options) on its own: the user parser
refuses every malformed object with a CaptureConfigError naming the key, and the worker's
reader refuses hand-made wire objects (the worker then fails that request alone)."""

from __future__ import annotations

import copy
import re
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from malformed_options import CORRUPTIONS, FLAGS, malformed

from probehook.capture_config import CaptureConfig
from probehook.core.monitors import ProbeMonitor
from probehook.core.request_options import (
    USER_KEYS,
    RequestOptions,
    RequestWire,
    WireMonitor,
)
from probehook.errors import CaptureConfigError
from probehook.saes.clamp import MAX_CLAMPED, SAEClamp, clamp_terms
from probehook.saes.readout import FeatureMonitor

MALFORMED = malformed()


def test_there_are_over_a_hundred_malformed_objects() -> None:
    assert len(MALFORMED) >= 100
    assert len(malformed(json_only=True)) >= 100


@pytest.mark.parametrize("value", MALFORMED, ids=[f"m{i}" for i in range(len(MALFORMED))])
def test_every_malformed_object_is_a_capture_config_error(value: Any) -> None:
    with pytest.raises(CaptureConfigError) as err:
        RequestOptions.from_user(value)
    message = str(err.value)
    assert message.startswith(("probehook option", "Unknown probehook option")), message
    # The message names the offending key (or, for a non-dict, the valid keys).
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        unknown = [k for k in value if k not in USER_KEYS]
        named = unknown or [k for k in value if k in message]
        assert named and all(repr(k) in message or k in message for k in named[:1]), message
    else:
        assert "valid" in message, message
    # The same object gives the same words every time (every front end calls this parser).
    with pytest.raises(CaptureConfigError) as again:
        RequestOptions.from_user(copy.deepcopy(value) if isinstance(value, dict) else value)
    assert str(again.value) == message


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("notadict", r"probehook options must be a dict .* not 'notadict' \(str\); valid keys"),
        (7, r"not 7 \(int\)"),
        ({"layers": "bogus"}, r"layers='bogus' \(str\) is not valid: pass a list of layer"),
        ({"layers": [0, "x"]}, r"layer 'x' \(str\) is not an int"),
        ({"include_prefill": "yes"}, r"include_prefill='yes' \(str\) is not valid: pass True"),
        ({"colour": 1, "tag": 2}, r"Unknown probehook option\(s\) 'colour', 'tag'; valid"),
        ({"probes": "truth"}, r"probes='truth' \(str\) is not valid: pass a list of probe"),
        ({"monitors": [{"probe": "t"}]}, r"monitors\[0\].* lacks \['threshold'\]"),
        (
            {"monitors": [{**{"probe": "t", "threshold": float("nan")}}]},
            r"monitors\[0\]: ProbeMonitor\('t'\) threshold is nan; it must be a finite number",
        ),
        ({"monitors": [{"probe": "t", "threshold": 1, "x": 1}]}, r"monitors\[0\]: Unknown"),
    ],
)
def test_messages_name_the_key_the_value_and_the_valid_values(value: Any, message: str) -> None:
    with pytest.raises(CaptureConfigError, match=message):
        RequestOptions.from_user(value)


@pytest.mark.parametrize(
    "value",
    [
        None,
        {},
        {"layers": [0, 3]},
        {"layers": "all"},
        {"layers": ["all"]},
        {"layers": []},
        {"probes": None, "monitors": None},
        {"probes": True},
        {"probes": False},
        {"probes": []},
        {"probes": ["truth"], "monitors": {"probe": "truth", "threshold": 0.5}},
        {"monitors": [ProbeMonitor("truth", 0.5, action="stop")]},
        *({flag: b} for flag in FLAGS for b in (True, False)),
    ],
)
def test_valid_options_parse(value: Any) -> None:
    options = RequestOptions.from_user(value)
    assert RequestOptions.from_user(options) is options


def test_numpy_layer_indices_are_ints() -> None:
    np = pytest.importorskip("numpy")
    assert RequestOptions.from_user({"layers": np.arange(2)}).layers == (0, 1)


def wire() -> RequestWire:
    config = CaptureConfig(layers=(0, 3), include_prefill=True)
    monitor = WireMonitor(ProbeMonitor("truth", 0.5, action="stop"), column=2)
    return RequestWire("abc-1", config, 2, True, ("truth",), (monitor,), 7, {"patch": 1})


def test_wire_round_trip() -> None:
    assert RequestWire.from_wire(wire().to_wire()) == wire()
    plain = RequestWire("t", CaptureConfig(layers=(1,)))
    assert RequestWire.from_wire(plain.to_wire()) == plain


@pytest.mark.parametrize("value", [None, "notadict", 7, [], {}, {"layers": [0]}])
def test_an_untagged_wire_is_no_request(value: Any) -> None:
    assert RequestWire.from_wire(value) is None


@pytest.mark.parametrize(("key", "value"), CORRUPTIONS)
def test_a_corrupt_wire_is_refused(key: str, value: Any) -> None:
    with pytest.raises(CaptureConfigError):
        got = RequestWire.from_wire({**wire().to_wire(), key: value})
        # Well formed but naming layers the engine does not tap: the worker's narrowing.
        assert got is not None
        CaptureConfig(layers=(0, 3), include_prefill=True).narrow(got.config.to_dict())


class State:
    def __init__(self, options: Any) -> None:
        self.sampling_params = SimpleNamespace(extra_args={"probehook": options}, stop=None)
        self.num_prompt_tokens = 4


def plan_for(options: Any, scores: bool = False, req_id: str = "0") -> Any:
    """The worker's plan for a request carrying ``options`` (what the step hook calls)."""
    from probehook.adapter.worker.runner_v1 import plan_factory

    runner = SimpleNamespace(requests={req_id: State(options)})
    engine = CaptureConfig(layers=(0, 3), include_prefill=True)
    return plan_factory(runner, engine, "scores" if scores else "hidden")(req_id)


def test_the_worker_plans_a_good_wire() -> None:
    plan = plan_for(wire().to_wire(), req_id="1_abc")
    assert plan.key == "abc-1/1" and plan.error is None and plan.layers == (0, 3)
    assert plan_for(wire().to_wire(), scores=True, req_id="1_abc").error is None


@pytest.mark.parametrize(("key", "value"), CORRUPTIONS)
@pytest.mark.parametrize("scores", [False, True])
def test_the_worker_fails_a_corrupt_wire_alone(key: str, value: Any, scores: bool) -> None:
    plan = plan_for({**wire().to_wire(), key: value}, scores, req_id="1_abc")
    if key == "tag":
        assert plan is None  # no stream key: no front end can collect it
        return
    assert plan.key == "abc-1/1" and "could not read" in plan.error, plan
    assert plan.keep.dense is None and plan.keep.latest_from is None


UNTAGGED = [v for v in MALFORMED if not (isinstance(v, dict) and "tag" in v)]


@pytest.mark.parametrize("value", [*UNTAGGED[:40], {"tag": None}, {"tag": ["x"]}])
def test_the_worker_ignores_untagged_garbage(value: Any) -> None:
    assert plan_for(value) is None
    assert plan_for(value, scores=True) is None


def test_the_monitor_processor_skips_a_corrupt_wire() -> None:
    from probehook.adapter.worker.monitor_processor import _watch

    good = wire().to_wire()
    params = SimpleNamespace(extra_args={"probehook": good}, min_tokens=0)
    watch = _watch(params, None, [])
    assert watch is not None and watch.stop_token == 7 and watch.stops[0].column == 2
    for key, value in CORRUPTIONS:
        params = SimpleNamespace(extra_args={"probehook": {**good, key: value}}, min_tokens=0)
        _watch(params, None, [])  # never raises
    for value in MALFORMED[:40]:
        assert _watch(SimpleNamespace(extra_args={"probehook": value}), None, []) is None
    assert _watch(SimpleNamespace(extra_args="junk"), None, []) is None


@pytest.mark.parametrize("key", ["layers", *FLAGS])
def test_a_wire_missing_a_capture_key_is_refused(key: str) -> None:
    broken = wire().to_wire()
    del broken[key]
    with pytest.raises(CaptureConfigError):
        RequestWire.from_wire(broken)


def test_the_worker_reuses_a_plan_only_where_it_applies() -> None:
    """Wires of one template (``plan``) share the first one's plan under their own keys,
    as long as the prompt length and completion index agree; anything else is read afresh.
    The same plans as reading every wire, for rows and for scores."""
    from probehook.adapter.worker.plan_cache import SharedReads, reuse_plans
    from probehook.adapter.worker.runner_v1 import plan_factory

    template = {**RequestWire("s-0", CaptureConfig((0, 3), True, include_decode=False), 2,
                              probes=("truth",)).to_wire(), "plan": "s-plan0"}  # fmt: skip
    requests: dict[str, State] = {}
    for req_id, tag, prompt_len, extra in [
        ("0_a", "s-1", 4, {}),
        ("0_b", "s-2", 4, {}),
        ("0_c", "s-3", 9, {}),  # another prompt length
        ("1_d", "s-4", 4, {}),  # the second completion
        ("0_e", "s-5", 4, {"plan": 3}),  # not a template name: fails alone
        ("0_h", "s-8", 4, {"include_prefill": "maybe"}),  # names the template, differs
        ("0_i", "s-9", 4, {"zzz": 1}),
        ("0_j", "s-10", 4, {"include_prefill": 1}),  # equal to True, but not a bool
        ("0_f", "s-6", 4, {"plan": None, "include_decode": True}),  # no template
        ("0_g", "s-7", 9, {"plan": None, "include_decode": True}),
    ]:
        options = {k: v for k, v in {**template, "tag": tag, **extra}.items() if v is not None}
        requests[req_id] = State(options)
        requests[req_id].num_prompt_tokens = prompt_len
    runner = SimpleNamespace(requests=requests)
    engine = CaptureConfig(layers=(0, 3), include_prefill=True)
    signatures = SharedReads(1)
    rows = reuse_plans(runner, plan_factory(runner, engine), signatures)
    scores = reuse_plans(runner, plan_factory(runner, engine, "scores"), signatures)
    for req_id in requests:
        for reuse, source in ((rows, "hidden"), (scores, "scores")):
            assert reuse(req_id) == plan_factory(runner, engine, source)(req_id), req_id
    for corrupt in ("0_e", "0_h", "0_i", "0_j"):
        assert "could not read" in (plan_factory(runner, engine)(corrupt).error or ""), corrupt
    assert signatures == {}  # the second recorder took each signature the first made


@pytest.mark.parametrize(
    ("held", "match"),
    [
        ({"1": 10**400}, r"clamp\['res3'\]\[.1.\] is .*must be a finite number"),
        ({"1": float("nan")}, r"must be a finite number"),
        ({"1": "2.0"}, r"is '2.0', not a number"),
        ({"1": True}, r"not a number"),
        ({str(i): 0.0 for i in range(MAX_CLAMPED + 1)}, rf"at most {MAX_CLAMPED} per SAE"),
    ],
)
def test_clamp_values_are_finite_numbers(held: dict, match: str) -> None:
    """Every clamp value gets a CaptureConfigError naming where it is (an int too large for
    a float used to escape as OverflowError)."""
    with pytest.raises(CaptureConfigError, match=match):
        clamp_terms({"res3": held}, "clamp")


def test_clamp_terms_take_numpy_numbers_and_digit_keys() -> None:
    assert clamp_terms({"res3": {"7": np.float32(2.5), 3: 0}}, "clamp") == (
        ("res3", ((3, 0.0), (7, 2.5))),
    )


@pytest.mark.parametrize(
    ("held", "match"),
    [
        ({"5": 1.0, "05": 2.0}, r"keys '5' and '05' both name feature 5; give each feature once"),
        ({5: 1.0, "5": 2.0}, r"keys 5 and '5' both name feature 5"),
        ({np.int64(3): 1.0, "003": 1.0}, r"both name feature 3"),
        ([[7, 1.0], [7, 2.0]], r"keys 7 and 7 both name feature 7"),  # the wire's pair form
        ({"\u00b2": 1.0}, r"'\u00b2' \(str\) is not a feature index"),  # "²".isdigit()
        ({"\u0663": 1.0}, r"is not a feature index"),  # Arabic-Indic 3: int() reads it
        ({" 5": 1.0}, r"is not a feature index"),
        ({"-1": 1.0}, r"is not a feature index"),
        ({-1: 1.0}, r"is not a feature index"),
    ],
)
def test_clamp_feature_keys_are_ascii_digits_named_once(held: Any, match: str) -> None:
    """Two keys naming one feature were summed by the worker (held at neither value), and
    "²" (str.isdigit, but not int()-able) escaped as a bare ValueError: both are the options
    error, naming the keys."""
    with pytest.raises(CaptureConfigError, match=match):
        clamp_terms({"res3": held}, "clamp")
    with pytest.raises(CaptureConfigError, match=r"^probehook option clamp\['res3'\]"):
        SAEClamp().check_terms({"res3": held}, {"res3": {"d_sae": 100}})


def test_clamp_terms_read_the_pair_form_and_leading_zeros() -> None:
    assert clamp_terms({"res3": [[7, 1.5], ["08", 0]]}, "clamp") == (
        ("res3", ((7, 1.5), (8, 0.0))),
    )


HUGE = 10**400
"""An int too large for a float (a JSON integer may be one)."""


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda t: ProbeMonitor("truth", t), r"ProbeMonitor\('truth'\) threshold is"),
        (lambda t: FeatureMonitor("res3", 4, t), r"FeatureMonitor\('res3', 4\) threshold is"),
        (
            lambda t: RequestOptions.from_user({"monitors": [{"probe": "truth", "threshold": t}]}),
            r"^probehook option monitors\[0\]: ProbeMonitor\('truth'\) threshold is",
        ),
        (
            lambda t: RequestOptions.from_user(
                {"monitors": [{"sae": "res3", "feature": 4, "threshold": t}]}
            ),
            r"^probehook option monitors\[0\]: FeatureMonitor\('res3', 4\) threshold is",
        ),
    ],
    ids=["probe", "feature", "request-probe", "request-feature"],
)
@pytest.mark.parametrize(
    ("threshold", "problem"),
    [
        (HUGE, r"it must be a finite number \(pass the score to cross"),
        (float("inf"), r"inf; it must be a finite number"),
        (float("nan"), r"nan; it must be a finite number"),
        ("0.5", r"'0.5', not a number; pass the score to cross"),
        (True, r"True, not a number"),
    ],
    ids=["huge-int", "inf", "nan", "str", "bool"],
)
def test_every_threshold_is_one_finite_number_check(make, match, threshold, problem) -> None:
    """A threshold of 10**400 raised OverflowError from FeatureMonitor (a served request's
    400 said only "int too large to convert to float"): every monitor's threshold gets one
    check, the options error naming the monitor, the field, the value and what to pass."""
    with pytest.raises(CaptureConfigError, match=match) as err:
        make(threshold)
    assert isinstance(err.value, CaptureConfigError)
    assert re.search(problem, str(err.value)), str(err.value)


def test_thresholds_of_any_number_type_are_floats() -> None:
    """numpy numbers are numbers (np.float32 was refused as "must be a number")."""
    for threshold in (np.float32(0.25), np.int64(1), 1, 0.5):
        probe = ProbeMonitor("truth", threshold)
        feature = FeatureMonitor("res3", 4, threshold)
        assert type(probe.threshold) is float and probe.threshold == float(threshold)
        assert type(feature.threshold) is float and feature.threshold == float(threshold)


@pytest.mark.parametrize("threshold", [HUGE, float("inf"), "x"], ids=["huge-int", "inf", "str"])
def test_a_wire_threshold_is_checked_not_raised(threshold: Any) -> None:
    """The worker's reader refuses a bad threshold with the options error (an int too large
    for a float raised OverflowError out of from_wire), for probe and feature monitors."""
    good = wire().to_wire()
    probe = {**good, "monitors": [{**good["monitors"][0], "threshold": threshold}]}
    feature = {
        **good,
        "readouts": {"sae": ["res3"]},
        "readout_monitors": [
            {
                "source": "sae",
                "sae": "res3",
                "feature": 4,
                "threshold": threshold,
                "action": "flag",
                "direction": "above",
                "slot": 0,
            }  # fmt: skip
        ],
    }
    for value in (probe, feature):
        with pytest.raises(CaptureConfigError, match="threshold is"):
            RequestWire.from_wire(value)
        plan = plan_for(value, req_id="1_abc")
        assert "could not read" in plan.error, plan
