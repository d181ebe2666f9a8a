"""`python -m ibex.ps --listen URI --shard I --num-workers N ...`: one parameter-server
shard, the `ibex-ps` binary linked into this package. Same flags (`--help`), same
behaviour: SIGTERM or SIGINT stops it after a final checkpoint. See docs/ps.md."""

import sys

from . import _native


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    return _native.run_ps(["ibex-ps", *args])


if __name__ == "__main__":
    sys.exit(main())
