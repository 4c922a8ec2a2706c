"""The old name of `lmforge.jobserver` (the REST job service), kept importable for one release.

`api/` sat beside `serve/`, which is also an HTTP API, so the job service was renamed after what it holds.
`import lmforge.api.app` and `from lmforge.api.store import Store` still work and give the very module
objects of `lmforge.jobserver` (one `Store` class, one set of module globals), with one DeprecationWarning
per process. Submodules are aliased on demand by a finder on sys.meta_path, so importing this package does
not import FastAPI or any job-server module.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

OLD, NEW = __name__, "lmforge.jobserver"

warnings.warn(f"{OLD} is renamed {NEW}; import {NEW} instead ({OLD} goes after this release)",
              DeprecationWarning, stacklevel=2)


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers `lmforge.api.X...` with the module `lmforge.jobserver.X...` itself."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(OLD + "."):
            return None
        new = NEW + fullname[len(OLD):]
        if importlib.util.find_spec(new) is None:
            return None  # no such module under the new name either: the usual ModuleNotFoundError
        return importlib.util.spec_from_loader(fullname, self, is_package=False)

    def create_module(self, spec):
        module = importlib.import_module(NEW + spec.name[len(OLD):])
        spec.loader_state = module.__spec__  # the import system overwrites __spec__; exec_module restores it
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state


if not any(isinstance(f, _Alias) for f in sys.meta_path):
    sys.meta_path.insert(0, _Alias())


def __getattr__(name: str):
    """`from lmforge.api import store` and `lmforge.api.store` after `import lmforge.api`."""
    if name.startswith("__"):
        raise AttributeError(name)
    try:
        return importlib.import_module(f"{OLD}.{name}")
    except ModuleNotFoundError:
        raise AttributeError(f"module {OLD!r} has no attribute {name!r}") from None
