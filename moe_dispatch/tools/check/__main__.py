"""``python -m moe_dispatch.tools.check`` and ``torchrun -m moe_dispatch.tools.check``: the command."""
from .launch import main

if __name__ == "__main__":
    raise SystemExit(main())
