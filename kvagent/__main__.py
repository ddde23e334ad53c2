"""``python -m kvagent``: the same program as the ``kvagent`` command."""

from __future__ import annotations

import sys

from kvagent.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
