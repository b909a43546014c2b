"""Shared test settings: Hypothesis profiles (CI runs the default, bounded one)."""

from hypothesis import HealthCheck, settings

settings.register_profile(
    "default", deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=100
)
settings.register_profile("thorough", deadline=None, max_examples=1000)
settings.load_profile("default")
