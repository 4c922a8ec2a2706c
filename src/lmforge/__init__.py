"""lmforge: from raw text to a trained, evaluated language model, with one config file."""

__version__ = "0.1.0"

__all__ = ["from_hf", "to_hf", "__version__"]


def __getattr__(name: str):
    # Lazy: `import lmforge` stays cheap, and the converters load only when used.
    if name in ("from_hf", "to_hf"):
        from lmforge.models import hf

        return getattr(hf, name)
    raise AttributeError(f"module 'lmforge' has no attribute {name!r}")
