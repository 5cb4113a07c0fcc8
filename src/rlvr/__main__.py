"""`python -m rlvr ...` is the `rlvr` command (useful where the venv's scripts are not on PATH)."""

import sys

from rlvr.cli import main

sys.exit(main())
