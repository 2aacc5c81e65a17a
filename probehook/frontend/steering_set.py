"""The front end's view of an engine's steering: named vectors, the steered layers, the bank's
capacity, and each request's checked steering.

It checks everything that can be checked before a request reaches the engine (vector names,
scales, phases, hidden size, layers), so the worker only ever receives steering it can apply.
It also names each request's prefix-cache salt: the KV of a steered prompt must never be
reused by a request with other steering (or none), so requests with different steering get
different salts (vLLM hashes ``cache_salt`` into the first block's key, and every later block
chains on it).

No vLLM imports.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from probehook.core.monitors import ProbeMonitor
from probehook.core.request_options import RequestOptions
from probehook.core.steering_ops import describe_op
from probehook.core.steering_wire import DEFAULT_CAPACITY, vector_wire
from probehook.errors import CaptureConfigError

SALT_PREFIX = "probehook-steer:"
INLINE_PREFIX = "inline:"
"""Bank names of vectors sent inside a request body (``probehook serve
--allow-inline-steering``): named by content, shared by the requests that send the same one."""


@dataclass(frozen=True)
class RequestSteer:
    """One request's steering, checked: what goes on the wire and what the output records."""

    terms: tuple[tuple[str, float], ...] = ()
    """(vector, scale) in the order they apply."""
    phase: str = "both"
    gates: tuple[ProbeMonitor, ...] = ()
    """Its ``action="steer"`` monitors (at most one)."""
    salt: str = ""
    """Its prefix-cache salt: equal for equal steering (same vectors' contents, ops and, where
    it matters, order)."""
    ops: tuple[tuple[str, str], ...] = ()
    """(vector, its op in words) of each vector whose op is not ``add``."""

    def describe(self) -> dict[str, Any]:
        """What a finished output and a stored record say about it (``start`` is filled in
        when the output is): ``vectors`` in the order they apply, and ``ops`` naming each
        vector's op where one is not ``add``."""
        out: dict[str, Any] = {"vectors": dict(self.terms), "phase": self.phase}
        if self.ops:
            out["ops"] = dict(self.ops)
        if self.gates:
            gate = self.gates[0]
            out["gate"] = {
                "probe": gate.probe,
                "threshold": gate.threshold,
                "direction": gate.direction,
                "label": gate.label,
                "vectors": dict(gate.steer),
            }
        return out


class SteeringSet:
    """An engine's steering vectors by name (front end)."""

    def __init__(
        self,
        vectors: Mapping[str, Any],
        *,
        layers: Sequence[int],
        capacity: int,
        num_layers: int,
        hidden_size: int,
        model_fingerprint: str | None,
    ) -> None:
        self.layers = tuple(sorted(layers))
        self.capacity = capacity
        self.num_layers = num_layers
        self.hidden_size = hidden_size
        self.model_fingerprint = model_fingerprint
        self.vectors: dict[str, Any] = {}
        self.inline_users: dict[str, int] = {}
        """Inline vectors in the bank, and how many running requests use each."""
        self.held: dict[str, int] = {}
        """Vectors that streaming requests in flight name (``hold``): not removable."""
        for name, vector in vectors.items():
            self.check(name, vector)
            self.vectors[name] = vector

    def check(self, name: str, vector: Any) -> None:
        """Refuse a vector the engine cannot hold: bad name, wrong model, unsteered layer,
        full bank, a name already taken."""
        from probehook.steering import SteeringVector

        if not isinstance(name, str) or not name:
            raise CaptureConfigError(f"Steering vector name {name!r} must be a non-empty string.")
        if not isinstance(vector, SteeringVector):
            raise CaptureConfigError(
                f"Steering vector {name!r} is a {type(vector).__name__}; pass a "
                "probehook.SteeringVector (SteeringVector({layer: direction}) or "
                "SteeringVector.load(path))."
            )
        if name in self.vectors:
            raise CaptureConfigError(
                f"A steering vector named {name!r} is already in the bank; remove_steering("
                f"{name!r}) first, or pick another name."
            )
        vector.check_model(self.num_layers, self.hidden_size, self.model_fingerprint)
        unsteered = sorted(set(vector.layers) - set(self.layers))
        if unsteered:
            raise CaptureConfigError(
                f"Steering vector {name!r} writes to layer(s) {unsteered}, but this engine "
                f"steers only layers {list(self.layers)} (they are fixed when the model is "
                "compiled). Build the engine with steering_layers=[...] naming every layer "
                "you will steer."
            )
        if len(self.vectors) >= self.capacity:
            raise CaptureConfigError(
                f"The steering bank is full: {self.capacity} vectors "
                f"({', '.join(sorted(self.vectors))}). Remove one with remove_steering(name), "
                "or build the engine with a larger steering_capacity=."
            )

    def add(self, name: str, vector: Any) -> dict[str, Any]:
        """Check and add a vector; return its wire form for the workers' banks."""
        self.check(name, vector)
        self.vectors[name] = vector
        return vector_wire(vector)

    def remove(self, name: str) -> None:
        if name not in self.vectors:
            raise CaptureConfigError(
                f"No steering vector named {name!r}; the engine has {sorted(self.vectors)}."
            )
        if self.held.get(name):
            raise CaptureConfigError(
                f"Steering vector {name!r} is named by {self.held[name]} request(s) in flight; "
                "remove it once they finish (a queued request would otherwise run unsteered)."
            )
        del self.vectors[name]

    def hold(self, steer: RequestSteer) -> list[str]:
        """Mark the vectors of a request in flight as in use; returns their names for
        :meth:`release`."""
        names = sorted({n for n, _ in steer.terms} | {n for g in steer.gates for n, _ in g.steer})
        for name in names:
            self.held[name] = self.held.get(name, 0) + 1
        return names

    def release(self, names: Sequence[str]) -> None:
        for name in names:
            left = self.held.get(name, 0) - 1
            if left > 0:
                self.held[name] = left
            else:
                self.held.pop(name, None)

    def acquire_inline(self, vector: Any) -> tuple[str, dict[str, Any] | None]:
        """The bank name of an inline vector for one more request, and its wire form when it
        is new (the caller puts it in the workers' banks); refused like :meth:`add`."""
        name = INLINE_PREFIX + vector.digest[:24]
        if name in self.inline_users:
            self.inline_users[name] += 1
            return name, None
        wire = self.add(name, vector)
        self.inline_users[name] = 1
        return name, wire

    def release_inline(self, name: str) -> bool:
        """One request less uses inline vector ``name``; True when it left the bank (the
        caller removes it from the workers' banks)."""
        users = self.inline_users.get(name, 0) - 1
        if users > 0:
            self.inline_users[name] = users
            return False
        self.inline_users.pop(name, None)
        if name in self.vectors:
            del self.vectors[name]
        return True

    def check_terms(self, terms: Sequence[tuple[str, float]], where: str) -> None:
        unknown = [name for name, _ in terms if name not in self.vectors]
        if unknown:
            own = sorted(n for n in self.vectors if n not in self.inline_users)
            raise CaptureConfigError(
                f"{where} names steering vector(s) {unknown}, which this engine does not have; "
                f"its vectors are {own} (add one with add_steering(name, vector))."
            )

    def for_request(
        self, options: RequestOptions, monitors: Sequence[ProbeMonitor], decode_scores: bool
    ) -> RequestSteer | None:
        """A request's steering (None: not steered). ``monitors``: the request's monitors;
        ``decode_scores``: whether its probe scores cover decode rows (a gate needs them)."""
        gates = tuple(m for m in monitors if m.action == "steer")
        if not options.steer and not gates:
            return None
        if options.steer:
            self.check_terms(options.steer, "probehook option steer")
        for gate in gates:
            self.check_terms(gate.steer, f"ProbeMonitor({gate.probe!r}, action='steer')")
        if len(gates) > 1:
            raise CaptureConfigError(
                f"This request has {len(gates)} monitors with action='steer'; one request may "
                "have at most one (combine their vectors in its steer={...})."
            )
        if gates and options.steer:
            raise CaptureConfigError(
                "This request sets both steer (from its start) and a monitor with "
                "action='steer' (from a crossing on); use one of them per request."
            )
        if gates and not decode_scores:
            raise CaptureConfigError(
                "A monitor with action='steer' watches decode rows, but this request's probe "
                "scores cover none (include_decode is False); set include_decode=True."
            )
        return self.request_steer(options.steer or (), options.steer_phase or "both", gates)

    def request_steer(
        self, terms: Sequence[tuple[str, float]], phase: str, gates: Sequence[ProbeMonitor]
    ) -> RequestSteer:
        """A checked request's steering with its salt and its vectors' ops."""
        names = [n for n, _ in terms] + [n for g in gates for n, _ in g.steer]
        ops = tuple((n, describe_op(self.vectors[n].op, self.vectors[n].op_params))
                    for n in dict.fromkeys(names) if self.vectors[n].op != "add")  # fmt: skip
        return RequestSteer(tuple(terms), phase, tuple(gates), self._salt(terms, phase, gates),
                            ops)  # fmt: skip

    def _salt(
        self, terms: Sequence[tuple[str, float]], phase: str, gates: Sequence[ProbeMonitor]
    ) -> str:
        # The vectors' contents (their digests cover each op and its parameters), not only
        # their names: a name removed and added again with another direction must not hit the
        # old prompt KV. Order matters unless every vector adds (a sum is a sum).
        def content(pairs: Sequence[tuple[str, float]]) -> list[Any]:
            out = [[self.vectors[name].digest, repr(float(scale))] for name, scale in pairs]
            adds = all(self.vectors[name].op == "add" for name, _ in pairs)
            return sorted(out) if adds else out

        parts = {
            "terms": content(terms),
            "phase": phase,
            "gates": [
                [g.probe, repr(float(g.threshold)), g.direction, g.label, content(g.steer)]
                for g in gates
            ],
        }
        digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
        return SALT_PREFIX + digest[:32]

    def describe(self) -> dict[str, Any]:
        """For ``GET /v1/probehook`` and logs."""
        return {
            "layers": list(self.layers),
            "capacity": self.capacity,
            "inline_in_use": len(self.inline_users),
            "vectors": {
                name: {
                    "layers": list(v.layers),
                    "digest": v.digest,
                    "op": describe_op(v.op, v.op_params),
                }  # fmt: skip
                for name, v in sorted(self.vectors.items())
                if name not in self.inline_users
            },
        }


def check_capacity(capacity: Any) -> int:
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise CaptureConfigError(
            f"steering_capacity={capacity!r} must be a positive int (the most vectors the "
            f"engine's bank holds at once; default {DEFAULT_CAPACITY})."
        )
    return capacity
