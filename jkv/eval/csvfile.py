"""The one CSV writer for result rows (`jkv eval --csv`, every experiments/ script).

One field-order rule everywhere: the columns are `fields` when the caller names them (keys
outside it are dropped, missing ones left empty), else every key of every row in first-seen
order (a key first seen in a later row goes after all earlier ones). Standard library only.
"""
from __future__ import annotations

import csv
import os
from collections.abc import Iterable, Sequence


def write_csv(path: str | os.PathLike, rows: Iterable[dict],
              fields: Sequence[str] | None = None) -> None:
    """Write `rows` (dicts) to `path` with a header; see the module docstring for the columns."""
    rows = list(rows)
    if fields is None:
        fields = list(dict.fromkeys(k for row in rows for k in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(fields), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
