"""`python -m ibex.ps --listen URI --shard I --num-workers N ...`: one parameter-server
shard, the `ibex-ps` binary linked into this package. Same flags (`--help`), same
behaviour: SIGTERM or SIGINT stops it after a final checkpoint. See docs/ps.md.

With IBEX_PS_EXIT_WITH_STDIN=1 in its environment (what `launch_local` sets), the shard
also stops that way when its standard input reaches end of file: the parent holds the
pipe's other end, so the shard never outlives it."""

import os
import signal
import sys
import threading
from typing import List, Optional

from . import _native


def _exit_with_stdin() -> None:
    def watch() -> None:
        try:
            while sys.stdin.buffer.read(4096):
                pass
        except (OSError, ValueError):
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="ibex-ps-parent-watch", daemon=True).start()


def main(argv: Optional[List[str]] = None) -> int:
    """Runs one shard until SIGTERM/SIGINT; returns its exit status."""
    args = sys.argv[1:] if argv is None else list(argv)
    if os.environ.get("IBEX_PS_EXIT_WITH_STDIN") == "1":
        _exit_with_stdin()
    return _native.run_ps(["ibex-ps", *args])


if __name__ == "__main__":
    sys.exit(main())
