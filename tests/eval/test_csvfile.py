"""jkv/eval/csvfile.py: the one CSV writer's field-order rule (first-seen keys, or the named
fields with extras dropped) and what it writes for missing values and no rows."""
import csv

from jkv.eval.csvfile import write_csv
from jkv.eval.harness import write_csv as harness_write_csv


def read(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_columns_are_keys_in_first_seen_order_over_all_rows(tmp_path):
    path = tmp_path / "rows.csv"
    write_csv(path, [dict(b=1, a=2), dict(a=3, c=None), dict(d=4, b=5)])
    assert read(path) == [["b", "a", "c", "d"], ["1", "2", "", ""], ["", "3", "", ""],
                          ["5", "", "", "4"]]


def test_named_fields_set_the_order_and_drop_other_keys(tmp_path):
    path = tmp_path / "rows.csv"
    write_csv(path, (r for r in [dict(x=1, y=2, z=3)]), fields=["z", "x", "w"])
    assert read(path) == [["z", "x", "w"], ["3", "1", ""]]
    write_csv(path, [], fields=["z", "x"])           # header even without rows
    assert read(path) == [["z", "x"]]


def test_the_harness_writer_is_the_same_function():
    assert harness_write_csv is write_csv
