"""zeroplan: does it fit, where do the bytes go, and which ZeRO config is best."""

__version__ = "0.1.0"
