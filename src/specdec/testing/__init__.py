"""Helpers for specdec's tests and benchmarks, never imported by the runtime (tests/test_layers.py checks)."""
