"""The package's version, in the lowest layer so that any module can name it without importing the package's
face (``clmerge/__init__.py``, which sits above every layer)."""

__version__ = "0.1.0"
VERSION = __version__

__all__ = ["VERSION", "__version__"]
