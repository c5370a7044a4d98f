"""Benchmarks of sparsecore, beside spconv where it is installed.

Run ``python -m sparsecore.benchmark cpu`` for the NumPy engine on a real LiDAR
scan (or a synthetic one when the scan is absent). It prints a table of median
times per stage (rulebook build, forward, backward, voxelization), spconv's
times for the same work with the same weights, their ratio, and whether the
two agree. Importing this package imports neither torch nor spconv; the
comparison imports them when it runs.
"""

from __future__ import annotations

from sparsecore.benchmark.cli import main

__all__ = ["main"]
