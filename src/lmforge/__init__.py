"""lmforge: from raw text to a trained, evaluated language model, with one config file."""

__version__ = "0.1.0"
