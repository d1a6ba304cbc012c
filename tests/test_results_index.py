"""experiments/results/README.md lists every committed output (first column of its tables), and
every file it lists exists; run logs are not kept there."""
import pathlib
import re

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "results"
LOG_SUFFIXES = {".log", ".out", ".txt"}


def listed_files(readme: str) -> set[str]:
    """Backticked names in the first column of every markdown table row (header and rule
    rows carry none)."""
    names = set()
    for line in readme.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            first_cell = line.split("|")[1]
            names |= set(re.findall(r"`([^`]+)`", first_cell))
    return names


def present_files() -> set[str]:
    return {str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*")
            if p.is_file() and p.name != "README.md" and p.suffix not in LOG_SUFFIXES}


def test_every_result_file_is_indexed_and_every_indexed_file_exists():
    listed = listed_files((RESULTS / "README.md").read_text())
    present = present_files()
    assert not present - listed, (f"{sorted(present - listed)} are not in "
                                  "experiments/results/README.md; add a row (script, command, doc)")
    assert not listed - present, (f"experiments/results/README.md lists {sorted(listed - present)}, "
                                  "which are not in experiments/results/")


def test_listed_files_reads_only_the_first_column():
    readme = ("| file | written by | cited in |\n|---|---|---|\n"
              "| `a.csv`, `b/c.png` | `python x.py --out `d.csv`` | docs/x.md (`e.csv`) |\n")
    assert listed_files(readme) == {"a.csv", "b/c.png"}
