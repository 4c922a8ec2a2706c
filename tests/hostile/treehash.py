"""Fingerprints of a directory tree: what a hostile-input test checks was left unchanged."""

from __future__ import annotations

import hashlib
from pathlib import Path


def tree_hash(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under `root` (directories by their listing)."""
    out = {}
    if not root.exists():
        return out
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "link:" + str(p.readlink())
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        elif p.is_dir():
            out[rel] = "dir"
    return out
