"""Benchmarks: timing helpers, the layer benchmark, CSV -> tables and plots."""
