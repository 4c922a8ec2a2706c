"""The package version, importable from any layer without loading the package's lazy exports."""

__version__ = "0.1.0"
