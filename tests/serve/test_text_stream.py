"""TextStream: streamed deltas concatenate to the final text; stop-string prefixes are held back."""
import pytest

from jkv.sampling import SamplingParams
from jkv.serving.text_stream import TextStream


class CharTok:
    """Token id i decodes to VOCAB[i]; 9 is a lone UTF-8 lead byte (renders as U+FFFD until completed)."""
    VOCAB = {1: "</s>", 2: "ab", 3: "c", 4: "STO", 5: "P", 6: " x", 7: "é", 8: "S"}

    def decode(self, ids):
        out = "".join(self.VOCAB.get(i, "") if i != 9 else "\ufffd" for i in ids)
        return out.replace("\ufffd" + "é", "€")  # 9 followed by 7 forms one character


def run(ids, **kw):
    ts = TextStream(CharTok(), SamplingParams(**{"max_tokens": 50, **kw}), eos_ids=(1,))
    deltas = []
    for t in ids:
        deltas.append(ts.push(t))
        if ts.finish_reason:
            break
    return deltas, ts


def test_stop_string_prefix_is_held_and_never_leaks():
    deltas, ts = run([2, 4, 5, 6], stop=("STOP",))
    assert deltas == ["ab", "", ""] and ts.text == "ab" and ts.finish_reason == "stop"


def test_held_prefix_is_released_when_the_stop_does_not_complete():
    deltas, ts = run([2, 4, 3, 6], stop=("STOP",), max_tokens=4)
    assert deltas == ["ab", "", "STOc", " x"] and ts.text == "abSTOc x" and ts.finish_reason == "length"


def test_incomplete_character_is_held_until_completed():
    deltas, ts = run([2, 9, 7, 1])
    assert deltas == ["ab", "", "€", ""] and ts.text == "ab€" and ts.output_ids == [2, 9, 7]


def test_eos_is_not_part_of_the_output():
    deltas, ts = run([3, 1])
    assert "".join(deltas) == ts.text == "c" and ts.output_ids == [3] and ts.ids == [3, 1]


@pytest.mark.parametrize("ids", [[2, 8, 4, 5, 3], [8, 8, 4, 3, 6, 9, 7], [6, 6, 6]])
def test_deltas_always_concatenate_to_the_text(ids):
    deltas, ts = run(ids, stop=("SSTOP", "x x"), max_tokens=len(ids))
    assert "".join(deltas) == ts.text
