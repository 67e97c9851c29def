"""BlockLab: experiments on Transformer architecture choices."""

__version__ = "0.1.0"
