"""Moved to lmforge.parallel.process_group: a module named `init` beside the package's `__init__` did not
say what it holds. This old import path stays for scripts written against it (the functions are the same
objects, so the process groups they keep are shared); new code imports process_group.
"""

from lmforge.parallel.process_group import (
    abandon,
    backend_for,
    coord_group,
    host_group,
    host_twin,
    init_distributed,
    shutdown,
)

__all__ = ["abandon", "backend_for", "coord_group", "host_group", "host_twin", "init_distributed", "shutdown"]
