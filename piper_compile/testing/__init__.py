"""Helpers shared by tests, examples and benchmarks: small models and a local multi-process launcher."""
