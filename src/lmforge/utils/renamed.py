"""Old import paths of renamed modules, kept for one release.

A module that moved leaves a file at its old path whose whole body is `renamed(__name__, NEW)`: importing
the old path then gives the new module object itself (so its functions, classes and private names are the
same objects, and patching one patches the other) and warns once with DeprecationWarning. With
`package=True` the old name's submodules are aliased too, on demand (`import OLD.sub` is `NEW.sub`), so
an alias imports nothing it is not asked for.

The target is a string, so tests/unit/test_layers.py cannot see it as an import: it lists the alias
modules (RENAMED there) and checks that nothing in src/ imports one.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType

_PACKAGES: dict[str, str] = {}  # old package name -> new one, answered by _Finder


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers `OLD.sub...` of an aliased package with the module `NEW.sub...` itself."""

    def _new_name(self, fullname: str) -> str | None:
        for old, new in _PACKAGES.items():
            if fullname.startswith(old + "."):
                return new + fullname[len(old):]
        return None

    def find_spec(self, fullname, path=None, target=None):
        new = self._new_name(fullname)
        if new is None or importlib.util.find_spec(new) is None:
            return None  # not ours, or a module under neither name: the usual ModuleNotFoundError
        return importlib.util.spec_from_loader(fullname, self, is_package=False)

    def create_module(self, spec):
        module = importlib.import_module(self._new_name(spec.name))
        spec.loader_state = module.__spec__  # the import system sets __spec__ to the alias's: put it back
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state


_FINDER = _Finder()


def renamed(old: str, new: str, package: bool = False) -> ModuleType:
    """Make the module being imported as `old` the module `new` (call it as a module's only statement)."""
    # stacklevel 3: the line that imported the old path (warn() skips the import system's own frames), so
    # Python shows it by default when that line is in __main__
    warnings.warn(f"{old} is renamed {new}; import {new} instead ({old} goes after this release)",
                  DeprecationWarning, stacklevel=3)
    module = importlib.import_module(new)
    sys.modules[old] = module  # the import system returns what sys.modules holds once the module has run
    if package:
        _PACKAGES[old] = new
        if _FINDER not in sys.meta_path:
            sys.meta_path.insert(0, _FINDER)
    return module
