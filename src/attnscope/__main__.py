"""``python -m attnscope``: the same as the ``attnscope`` command."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
