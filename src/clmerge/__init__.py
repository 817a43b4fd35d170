"""clmerge: continual learning and model merging on pretrained models."""

__version__ = "0.1.0"
