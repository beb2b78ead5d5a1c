"""The version of ckptd (a leaf module, so that the format layer can name it without importing the package)."""

__version__ = "0.1.0"
