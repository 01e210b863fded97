"""``python -m bench``: see bench/run.py (``scripts/bench.sh`` is the way to call it)."""

import sys

from bench.run import main

sys.exit(main())
