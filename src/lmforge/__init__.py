"""lmforge: from raw text to a trained, evaluated language model, with one config file.

The Python API, for those who live in notebooks and scripts:

    import lmforge
    trainer = lmforge.Trainer("configs/demo.yaml")                    # what `lmforge train` runs
    trainer = lmforge.Trainer(model=my_module, train_data=texts, tokenizer="tokenizer.json",
                              config={"train": {"max_steps": 200}}, callbacks=[MyCallback()])
    metrics = trainer.fit()
"""

from lmforge._version import __version__

__all__ = ["Callback", "Config", "Trainer", "__version__", "build_run", "from_hf", "load_config", "to_hf"]

_LAZY = {
    "from_hf": "lmforge.models.hf", "to_hf": "lmforge.models.hf",
    "Trainer": "lmforge.train.trainer", "Callback": "lmforge.train.callbacks",
    "Config": "lmforge.config.schema", "load_config": "lmforge.config.load",
    "build_run": "lmforge.assembly",
}


def __getattr__(name: str):
    # Lazy: `import lmforge` stays cheap (no torch until a name that needs it is used).
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lmforge' has no attribute {name!r}")
