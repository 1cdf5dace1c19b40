"""`python -m coreserve serve ...`: the same as the `coreserve` command (frontend process, entry point)."""

from __future__ import annotations

from coreserve.frontend.cli import main

if __name__ == "__main__":
    main()
