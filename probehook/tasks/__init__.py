"""Toy tasks shared by the tiny-model training script, the tests and the demos."""
