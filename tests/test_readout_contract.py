"""The readout table's contract, checked on the code itself: no top-k readout is special-cased
in the shared folders (issue 50's acceptance grep), and SAE features are an ordinary entry,
registered through the output-processor entry point as a third party's readout would be."""

from __future__ import annotations

import shutil
import subprocess
from importlib.metadata import entry_points
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATTERN = (
    r'"sae"|\bsaes\b|SAESet|SAEFeatureRows|FeatureFlags|LensFlags|TOP_K_BANKS|'
    r'SHARDED_READOUTS|READOUT_MONITORS|"lens"'
)
SHARED = ["adapter", "frontend", "core", "store", "viewer"]


@pytest.mark.skipif(shutil.which("grep") is None, reason="needs grep")
def test_no_readout_is_named_in_the_shared_folders() -> None:
    """Issue 50's grep, as it is written there, finds nothing: the adapter, front end, core,
    store and viewer name no readout (SAE features and lenses declare what they need). It
    found 227 lines before the SAE port."""
    folders = [str(ROOT / "probehook" / f) for f in SHARED]
    found = subprocess.run(
        ["grep", "-rnE", PATTERN, *folders], capture_output=True, text=True, check=False
    )
    assert found.returncode in (0, 1), found.stderr  # 1: nothing found
    assert found.stdout == "", f"readouts named in shared code:\n{found.stdout}"


def test_sae_features_come_through_the_entry_point() -> None:
    """The SAE readout is registered as a third party's is (``probehook.output_processors``),
    with its monitor and flags, and keeps its public names."""
    import probehook
    from probehook.outputs import OUTPUT_PROCESSORS
    from probehook.outputs.top_k_readout import top_k_readouts

    points = {e.name: e.value for e in entry_points(group="probehook.output_processors")}
    assert points.get("sae_features") == "probehook.saes.readout:SAEReadout"
    readout = top_k_readouts(OUTPUT_PROCESSORS)["sae"]
    assert type(readout).__module__ == "probehook.saes.readout"
    assert readout.monitor is probehook.FeatureMonitor
    assert readout.completion_attributes == ("sae_features",)
    assert readout.request_attributes == ("prefill_sae_features",)
    assert (readout.engine_option, readout.k_option) == ("saes", "sae_top_k")
    assert OUTPUT_PROCESSORS["feature_flags"].completion_attributes == ("feature_flags",)
    # The engines' keyword arguments show every readout's options (help(LLM), editors).

    from probehook.frontend.capture_request import front_end_signature

    params = front_end_signature([]).parameters
    for option in ("saes", "sae_top_k", "sae_clamping", "sae_dtype", "lenses", "lens_layers"):
        assert option in params, option


def test_a_readout_the_engine_lacks_asked_for_nothing_is_accepted() -> None:
    """``{"saes": False}`` (a client that sends it to every server) passes an engine without
    SAEs, as it did before the port; asking for features there is refused, naming the engine
    option; an engine that reads SAEs keeps the option for its own checks."""
    from probehook.errors import CaptureConfigError
    from probehook.frontend.readout_set import without_unread

    asked = {"saes": False, "sae_top_k": None, "layers": [1]}
    assert without_unread(asked, {"lens"}) == {"layers": [1]}
    assert without_unread(asked, {"sae", "lens"}) is asked
    with pytest.raises(CaptureConfigError, match=r"sets saes, .* build it with saes="):
        without_unread({"saes": ["res3"]}, set())
    assert without_unread(None, set()) is None
