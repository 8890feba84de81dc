"""The `moe-dispatch` console script.

    moe-dispatch check [options]     the rank-consistency check (see `moe-dispatch check --help`)
    moe-dispatch ops-demo [options]  permute/unpermute error vs float64 and repeatability
    moe-dispatch --version           print the version

Each command checks all its flags before it starts any work or process: a bad flag exits with
status 2 and one message naming it.
"""
from __future__ import annotations

import sys
from typing import Optional


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        # Asked for help: stdout, status 0; no command: a usage error, stderr, status 2.
        print(__doc__.strip(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "--version":
        from .. import __version__
        print(f"moe-dispatch {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command == "check":
        from .check import main as check_main
        return check_main(rest)
    if command == "ops-demo":
        from .ops_demo import main as demo_main
        return demo_main(rest)
    print(f"moe-dispatch: unknown command {command!r}; expected 'check' or 'ops-demo'", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
