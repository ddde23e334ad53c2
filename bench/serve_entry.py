"""``python -m bench.serve_entry serve ...``: ``kvagent serve`` as the side-by-side figure runs it.

The one difference from the installed command: the slot's listener never sheds (``shed_after=inf``), as in
the in-process figures (bench/agent_run.py). Past its byte budget a deployed agent drops what it queued and
repairs from the engine's replay ROUTER, to stay current; in a burst benchmark that would be loss, so here
the listener stops reading instead and the publisher queues (its SNDHWM is 0). Dynamo's indexer does the
same by nature (its SUB pushes back). Everything else is ``kvagent.cli.main``'s own code path.

Started like every bench ``kvagent serve``: ``bench.serve_process.start_serve(args, workdir,
entry=NEVER_SHED_ENTRY)``.
"""

from __future__ import annotations

import functools
import math
import sys

import kvagent.cli.serve as serve_module
from kvagent.cli.main import main
from kvagent.vllm.listener import ListenerOptions


def never_shed() -> None:
    if getattr(serve_module, "ListenerOptions", None) is not ListenerOptions:
        raise SystemExit(
            "bench.serve_entry: kvagent.cli.serve no longer builds ListenerOptions by that name; "
            "update bench/serve_entry.py so the burst figure stays loss-free"
        )
    # setattr: the module's name is replaced for this process only (it is not part of its typed interface).
    setattr(serve_module, "ListenerOptions", functools.partial(ListenerOptions, shed_after=math.inf))  # noqa: B010


if __name__ == "__main__":
    never_shed()
    sys.exit(main(sys.argv[1:]))
