"""What every benchmark records about the machine it ran on (imported by the bench scripts)."""

from __future__ import annotations

import datetime as _dt
import os
import platform
from pathlib import Path

import torch


def machine_info(**extra) -> dict:
    """CPU model and capability, core count, versions, date and load average, plus `extra`."""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return dict(
        cpu_model=cpu,
        cpu_count=os.cpu_count(),
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        torch=torch.__version__,
        python=platform.python_version(),
        **extra,
        date=_dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        loadavg_at_start=list(os.getloadavg()),
    )


def print_markdown_table(headers: list[str], rows: list[list[str]]) -> None:
    """Right-aligned markdown table (what the README quotes)."""
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"

    print(line(headers))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print(line(row))


def write_results(path, args, rows: list[dict], summary: dict) -> dict:
    """{machine, args, rows, summary} of a bench run written to `path` (a pathlib.Path; its folder made) and
    the summary printed; returned."""
    import json

    out = {"machine": machine_info(), "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
           "summary": summary}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(summary, indent=1))
    return out
