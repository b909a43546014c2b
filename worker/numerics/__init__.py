"""Exact arithmetic that the models and the sampler share: the fixed-point grids
(fixed_point.py). Imports no model, so sampling depends on no model."""
