"""``python -m clmerge.cli``: the same as the ``clmerge`` command."""

from . import main

if __name__ == "__main__":
    main()
