"""The package's version, on its own so that modules inside the package can read it without
importing ``probehook`` itself (whose facade would pull in every layer)."""

__version__ = "0.1.0"
