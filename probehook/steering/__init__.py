"""Steering vectors: residual-stream directions per layer, made offline and saved as one file.

No vLLM here: vectors are built by hand, from an activation store (mean difference of two
classes of requests) or from a binary linear probe, and added at run time by the engine.
"""

from probehook.steering.vector import SteeringVector, mean_residual_norm

__all__ = ["SteeringVector", "mean_residual_norm"]
