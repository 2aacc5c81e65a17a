"""Malformed per-request ``probehook`` option objects, generated systematically, shared by the
unit tests of the parser (test_request_options.py) and the tests that send them through every
front end. Each of these fails :meth:`RequestOptions.from_user` whatever the engine is, so
every front end must refuse it with the same message."""

from __future__ import annotations

import json
import math
from typing import Any

FLAGS = ("include_prefill", "include_decode", "last_prefill_token", "last_decode_token")
GOOD_MONITOR = {"probe": "truth", "threshold": 0.5}


def _monitors() -> list[Any]:
    bad_fields: list[dict[str, Any]] = [
        {"probe": "truth"},  # no threshold
        {"threshold": 0.5},  # no probe
        {},
        {**GOOD_MONITOR, "threshold": "high"},
        {**GOOD_MONITOR, "threshold": None},
        {**GOOD_MONITOR, "threshold": True},
        {**GOOD_MONITOR, "threshold": [0.5]},
        {**GOOD_MONITOR, "probe": 3},
        {**GOOD_MONITOR, "probe": ""},
        {**GOOD_MONITOR, "probe": None},
        {**GOOD_MONITOR, "probe": ["truth"]},
        {**GOOD_MONITOR, "action": "explode"},
        {**GOOD_MONITOR, "action": None},
        {**GOOD_MONITOR, "direction": "sideways"},
        {**GOOD_MONITOR, "direction": 1},
        {**GOOD_MONITOR, "colour": "red"},
        {**GOOD_MONITOR, "column": 0},  # a wire field, not a user one
    ]
    out: list[Any] = [[m] for m in bad_fields]
    out += [
        "stop",
        1,
        True,
        [1],
        ["stop"],
        [None],
        [[GOOD_MONITOR]],
        [GOOD_MONITOR, "x"],
        {"probe": {"nested": {"deep": [1, 2]}}, "threshold": 0.5},
    ]
    return [{"monitors": m} for m in out]


def malformed(json_only: bool = False) -> list[Any]:
    """The objects; ``json_only``: only those a JSON request body can carry."""
    objects: list[Any] = [
        # wrong top-level types
        "notadict",
        "",
        7,
        0,
        3.5,
        True,
        False,
        [],
        ["layers"],
        [{"layers": [0]}],
        # unknown keys, including probehook's own wire keys and near misses
        {"colour": 1},
        {"tag": "x"},
        {"n": 2},
        {"stream": True},
        {"stop_token": 3},
        {"record": {}},
        {"column": 0},
        {"Layers": [0]},
        {"layer": [0]},
        {"probe": ["truth"]},
        {"monitor": [GOOD_MONITOR]},
        {"": 1},
        {"layers": [0], "colour": 1},
        # steering of the wrong type
        {"steer": "v"},
        {"steer": {}},
        {"steer": []},
        {"steer": 1.0},
        {"steer": {"v": "1"}},
        {"steer": {"v": True}},
        {"steer": {"v": None}},
        {"steer": {"v": [1.0]}},
        {"steer": {"": 1.0}},
        {"steer": ["v"]},
        {"steer_phase": "both"},  # without steer
        {"steer": {"v": 1.0}, "steer_phase": "middle"},
        {"steer": {"v": 1.0}, "steer_phase": 1},
        # layers of the wrong type
        {"layers": "bogus"},
        {"layers": "ALL"},
        {"layers": ""},
        {"layers": 0},
        {"layers": 2},
        {"layers": 1.5},
        {"layers": True},
        {"layers": None},
        {"layers": {"a": 1}},
        {"layers": [0.5]},
        {"layers": ["0"]},
        {"layers": [True]},
        {"layers": [None]},
        {"layers": [[0]]},
        {"layers": [0, "x"]},
        {"layers": [{"layer": 0}]},
        {"layers": ["all", 0]},
        # probes of the wrong type
        {"probes": "truth"},
        {"probes": 1},
        {"probes": 0},
        {"probes": 1.5},
        {"probes": {"truth": True}},
        {"probes": [1]},
        {"probes": [None]},
        {"probes": [""]},
        {"probes": [["truth"]]},
        {"probes": [True]},
        {"probes": ["truth", {"nested": [1]}]},
        # nested garbage
        {"include_prefill": {"yes": True}},
        {"layers": [0], "probes": {"nested": {"deep": [1, 2]}}},
    ]
    for flag in FLAGS:  # every boolean key, every kind of non-boolean
        objects += [{flag: v} for v in ("yes", "true", 1, 0, None, [], {}, 1.0)]
    objects += _monitors()
    if not json_only:
        objects += [
            {1: 2},
            {None: True},
            {"layers": [0], 3: "x"},
            {"monitors": [{**GOOD_MONITOR, "threshold": math.nan}]},
            {"monitors": [{**GOOD_MONITOR, "threshold": math.inf}]},
            {"monitors": [{**GOOD_MONITOR, "threshold": -math.inf}]},
            {"monitors": [{**GOOD_MONITOR, "threshold": 10**400}]},
            {"monitors": [{1: "truth", "threshold": 0.5}]},
            {"steer": {"v": math.nan}},
            {"steer": {"v": math.inf}},
            {"steer": {"v": 10**400}},
            {"steer": {1: 1.0}},
            {"probes": {"truth"}},
            {"layers": {0, 2}},
            {"layers": b"\x00"},
            object(),
            b"probehook",
        ]
    else:
        for obj in objects:
            json.dumps(obj, allow_nan=False)  # a JSON body can carry it
    return objects


CORRUPTIONS: list[tuple[str, Any]] = [
    # (key, value) set in a valid wire object (RequestWire.to_wire): what the worker may
    # receive from a path that skipped the front end
    ("tag", 5),
    ("tag", ""),
    ("n", "x"),
    ("n", 0),
    ("stream", "yes"),
    ("layers", "bogus"),
    ("layers", [0, -1]),
    ("layers", None),
    ("layers", [0, 1]),  # well formed, but a layer the engine does not tap
    ("layers", [5]),
    ("include_decode", "maybe"),
    ("include_prefill", None),
    ("probes", 7),
    ("probes", [1]),
    ("monitors", "x"),
    ("monitors", [1]),
    ("monitors", [{"probe": "truth", "threshold": 0.5}]),  # no column
    ("monitors", [{"probe": "truth", "threshold": 0.5, "column": "a"}]),
    ("monitors", [{"probe": "truth", "threshold": float("nan"), "column": 0}]),
    ("monitors", [{"probe": "truth", "threshold": 0.5, "column": 0, "action": "boom"}]),
    ("stop_token", "eos"),
    ("stop_token", -1),
    ("record", 5),
    ("steer", "v"),
    ("steer", {"v": float("nan")}),
    ("steer_phase", "middle"),
    ("monitors", [{"probe": "truth", "threshold": 0.5, "column": 0, "action": "steer"}]),
    ("zzz", 1),
]


def malformed_inline_vectors(hidden: int, layer: int) -> list[Any]:
    """``steer_vectors`` values a JSON body can carry that a server allowing inline vectors
    must refuse with a 400 (``hidden``: the model's width; ``layer``: a steered layer)."""
    good = [0.5] * hidden
    key = str(layer)
    vectors: list[Any] = [
        None,
        "v",
        1,
        1.5,
        True,
        [],
        ["v"],
        [good],
        {},  # not an object of named vectors
        {"v": None},
        {"v": "x"},
        {"v": 1},
        {"v": []},
        {"v": [good]},
        {"v": {}},  # not layer maps
        {"": {key: good}},  # an empty name
    ]
    for bad_key in ("x", "", "-1", "1.5", "1e3", " ", "99", "0x2", "true"):
        vectors.append({"v": {bad_key: good}})
    for bad in (
        [],
        good[:-1],
        good + [0.5],
        ["0.5"] * hidden,
        [None] * hidden,
        [True] * hidden,
        [[0.5]] * hidden,
        [{}] * hidden,
        [1e308] * hidden,  # 1e308: finite, not in float32
        "0.5",
        0.5,
        {"0": 0.5},
    ):
        vectors.append({"v": {key: bad}})
    vectors.append({f"v{i}": {key: good} for i in range(9)})  # too many
    for value in vectors:
        json.dumps(value, allow_nan=False)  # a JSON body can carry it
    return vectors
