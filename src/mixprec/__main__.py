"""``python -m mixprec``: the command line (see :mod:`mixprec.cli`)."""

from __future__ import annotations

from mixprec.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
