"""Real text and code that ship with every Python installation (no downloads): the corpus
the selectors calibrate on (jkv.selection.calibration) and the evaluation tasks read (jkv.eval).

Prose: the Python reference-manual topics in `pydoc_data.topics` (~460K characters of
English documentation), split by topic name into a calibration half and an evaluation half so
fitted selectors (InfiniGen skew, HATA hashes) never see the evaluation text.
Code: the standard library's own `.py` files (`sysconfig.get_paths()["stdlib"]`); `code_files`
/ `code_text` split them by file into a calibration half (the first half of the sorted list) and an
evaluation half (the second).
Held-out prose: the licence texts of /usr/share/common-licenses (`licence_text`), in no
calibration set: the domain the profile search and the selectors' fits never see.
"""
from __future__ import annotations

import glob
import os
import sysconfig

LICENCES = "/usr/share/common-licenses"


def long_text(split: str) -> str:
    """The concatenated documentation topics of one split: 'calibration' or 'eval'."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    if split == "calibration":
        chosen = names[1::2]
    elif split == "eval":
        chosen = names[0::2]
    else:
        raise ValueError(f"{split=} must be 'calibration' or 'eval'")
    return "\n\n".join(topics[name].strip() for name in chosen)


def stdlib_sources(min_chars: int = 4000, limit: int | None = None) -> list[str]:
    """Paths of top-level stdlib modules with at least `min_chars` characters, sorted by name."""
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if name.endswith(".py") and not name.startswith("_") and os.path.getsize(path) >= min_chars:
            paths.append(path)
    if not paths:
        raise FileNotFoundError(f"no stdlib .py sources found under {root}")
    return paths[:limit] if limit else paths


def code_files(split: str) -> list[str]:
    """The stdlib source paths of one half of `stdlib_sources()`: 'calibration' (the first half of
    the sorted list) or 'eval' (the second)."""
    files = stdlib_sources()
    if split == "calibration":
        return files[:len(files) // 2]
    if split == "eval":
        return files[len(files) // 2:]
    raise ValueError(f"{split=} must be 'calibration' or 'eval'")


def code_text(split: str) -> str:
    """The concatenated stdlib sources of `code_files(split)`. The held-out fidelity run
    (experiments/heldout_domain.py) calibrates on the first half and scores on the second."""
    parts = []
    for path in code_files(split):
        with open(path, encoding="utf-8", errors="replace") as f:
            parts.append(f.read())
    return "\n\n".join(parts)


def licence_text() -> str:
    """The licence texts of /usr/share/common-licenses, concatenated in name order (held-out prose)."""
    paths = sorted(p for p in glob.glob(os.path.join(LICENCES, "*")) if os.path.isfile(p))
    if not paths:
        raise FileNotFoundError(f"no licence texts under {LICENCES} on this machine (the held-out prose domain)")
    parts = []
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            parts.append(f.read())
    return "\n\n".join(parts)
