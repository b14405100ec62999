"""Benchmarks run by ``tierkv bench``: measured side by side with their baselines in one run."""
