"""Check that a README of before lost nothing when it became a front page: every section heading and
every bold-led paragraph of the old README (`git show REF:README.md`) is found again, word for word,
in README.md or a page under docs/.

    python docs/_tools/check_readme_moved.py f5fd0b8     # the README before issue 33

Prints what it cannot find and exits 1 then; 0 when everything landed somewhere.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def landmarks(readme: str) -> list[str]:
    """Section headings (`## ...`) and the bold lead of each paragraph or list item (`**...**`)."""
    found = re.findall(r"^#{2,3} (.+)$", readme, re.M)
    found += re.findall(r"^(?:- )?(\*\*[^*\n]+\*\*)", readme, re.M)
    return found


def main(ref: str) -> int:
    old = subprocess.run(["git", "show", f"{ref}:README.md"], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    now = "\n".join(p.read_text(encoding="utf-8") for p in pages)
    missing = [m for m in landmarks(old) if m not in now]
    for m in missing:
        print(f"not found: {m}")
    print(f"{len(landmarks(old)) - len(missing)} of {len(landmarks(old))} headings and bold leads of {ref}'s "
          "README found in README.md + docs/")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "HEAD"))
