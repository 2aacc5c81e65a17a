"""Linear probes over the residual stream: build, fit on an activation store, save, sweep.

No vLLM here: probes are trained offline from ``probehook.store`` and applied at run time by the
engine through ``LinearProbe.linear()`` and ``LinearProbe.activate()``.
"""

from probehook.errors import ProbeError
from probehook.probes.linear import LinearProbe, ProbeSplit
from probehook.probes.sweep import SweepResult, SweepRow, sweep

__all__ = ["LinearProbe", "ProbeError", "ProbeSplit", "SweepResult", "SweepRow", "sweep"]
