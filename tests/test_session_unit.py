"""CaptureSession.tag on its own (no engine): what per-request options it accepts."""

from __future__ import annotations

import pytest

from probehook.capture_config import CaptureConfig
from probehook.errors import CaptureConfigError
from probehook.frontend.session import CaptureSession


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
