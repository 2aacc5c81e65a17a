"""Reading each distinct request plan once per worker: requests whose wires differ only in
their tag share one plan, and the recorders of a worker, which meet each new request in the
same step, share the wire the first of them read (:class:`SharedReads`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from probehook.adapter.worker import runner_v1
from probehook.core.request_options import EXTRA_ARGS_KEY, PLAN_KEY
from probehook.worker.recorder import RequestPlan

MAX_CACHED_PLANS = 4096
PlanFor = Callable[[str], RequestPlan | None]


def reuse_plans(runner: Any, plan_for: PlanFor, signatures: SharedReads | None = None) -> PlanFor:
    """``plan_for`` that reads each distinct request plan once: requests whose wires differ
    only in their tag (a batch of requests with the same options and prompt length, such as
    the patches of an image) get the plan of the first, under their own stream key. Reading
    a wire and building its keep plan costs tens of microseconds per request and recorder,
    which a one-pass request has no decode steps to spread over. ``signatures``: shared by
    the recorders of a worker, which meet each new request in the same step; the later ones
    take the wire, the signature and the template check the first worked out."""
    cache: dict[tuple, tuple[RequestPlan | None, _Template | None, str]] = {}

    def cached(req_id: str) -> RequestPlan | None:
        try:
            shared = signatures.take(req_id) if signatures is not None else None
            if shared is not None:  # another recorder read this wire in this step
                raw, known, verified = shared
            else:
                state = runner.requests.get(req_id)
                params = runner_v1.request_params(state)
                raw = runner_v1.extra_options(params).get(EXTRA_ARGS_KEY)
                known, verified = _plan_signature(raw, req_id, state, params), None
        except Exception:  # noqa: BLE001 - plan_for reports what it cannot read
            known = None
        if known is None:
            return plan_for(req_id)
        signature, shape = known
        hit = cache.get(signature)
        if hit is not None:
            plan, template, suffix = hit
            if template is not None and template is not verified and not template.matches(shape):
                # The wire names a template it does not match (it did not come from the
                # front end as written): read it afresh, and do not cache what it gets.
                return plan_for(req_id)
            if signatures is not None and shared is None:
                signatures.share(req_id, (raw, known, template))
            if plan is None:
                return None
            return RequestPlan(
                raw["tag"] + suffix, plan.keep, plan.stream, plan.layers, None, plan.one_pass
            )
        if signatures is not None and shared is None:
            signatures.share(req_id, (raw, known, None))
        plan = plan_for(req_id)
        if plan is None or plan.error is None:
            if len(cache) >= MAX_CACHED_PLANS:
                cache.clear()
            suffix = plan.key[plan.key.rindex("/") :] if plan is not None else ""
            cache[signature] = (plan, _Template(shape) if shape is not None else None, suffix)
        return plan

    return cached


_SCALARS = (bool, int, float, str, type(None))


class _Template:
    """The first wire read of a template (``plan``), which later wires naming it must equal
    but for their tag, value types included (``include_prefill: 1`` is not ``True``)."""

    __slots__ = ("wire", "types")

    def __init__(self, wire: dict[str, Any]) -> None:
        self.wire = dict(wire)  # a copy of its own: matches() writes the tag into it
        self.types = tuple(map(type, wire.values()))

    def matches(self, raw: dict[str, Any]) -> bool:
        wire = self.wire
        wire["tag"] = raw["tag"]  # the one value that differs; both compare in C
        return raw == wire and tuple(map(type, raw.values())) == self.types


class SharedReads(dict):
    """What one recorder read of a new request's wire (the wire, its signature, the template
    shape it was checked against), left for the worker's other recorders, which meet the
    request in the same step: each entry is taken by ``readers`` of them, then dropped."""

    def __init__(self, readers: int) -> None:
        super().__init__()
        self.readers = readers

    def take(self, req_id: str) -> tuple | None:
        entry = self.get(req_id)
        if entry is None:
            return None
        entry[1] -= 1
        if entry[1] <= 0:
            del self[req_id]
        return entry[0]

    def share(self, req_id: str, read: tuple) -> None:
        if len(self) >= MAX_CACHED_PLANS:
            self.clear()  # requests the other recorders never met
        self[req_id] = [read, self.readers]


def _plan_signature(raw: Any, req_id: str, state: Any, params: Any) -> tuple | None:
    """Everything a request's plan depends on except its tag, as ``(signature, shape)``
    (None: do not reuse plans for it). The signature holds the wire's template (``plan``,
    set by the front end on wires that differ only in their tag) or else its other values
    with their types (a wire with nested values, such as monitors or a store record, is read
    afresh), the prompt length, whether the request has stop strings, and the
    completion-index prefix of its engine id. ``shape``, for a template's wire: the wire
    itself, compared with the template's first (:class:`_Template`, never hashed) so that a
    wire that names a template without matching it is read afresh."""
    tag = raw.get("tag") if isinstance(raw, dict) else None
    if type(tag) is not str or not tag:
        return None
    head = req_id.split("_", 1)[0] if "_" in req_id else ""
    stop = bool(getattr(params, "stop", None))
    template = raw.get(PLAN_KEY)
    if type(template) is str:
        return (template, state.num_prompt_tokens, stop, head), raw
    items: list[tuple] = []
    for key, value in raw.items():
        if key == "tag":
            continue
        kind = type(value)
        if kind is list or kind is tuple:
            if not all(type(v) in _SCALARS for v in value):
                return None
            value = (kind, *((type(v), v) for v in value))
        elif kind not in _SCALARS:
            return None
        items.append((key, kind, value))
    return (tuple(items), state.num_prompt_tokens, stop, head), None
