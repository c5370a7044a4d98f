"""``python -m sparsecore.benchmark cpu [--voxels PATH] [--points PATH] [--repeat N] [--threads N] [--json PATH]``."""

from __future__ import annotations

import sys

from sparsecore.benchmark.cli import main

if __name__ == "__main__":
    sys.exit(main(allow_reexec=True))
