"""``python -m clmerge``: the same as the ``clmerge`` command."""

from .cli import main

if __name__ == "__main__":
    main()
