"""Incremental detokenisation (actors/text.py) on the embedded model's byte-level tokenizer.

Regression (defect: every commit re-decoded the whole output and took the text delta by string
prefix, O(n^2) and wrong when decoding is not prefix-stable): emoji and CJK outputs, whose
characters span several tokens, stream deltas that (a) never contain a broken character, (b)
add up to exactly the full decode, whether tokens arrive one at a time or in blocks of a verify
step; stop strings cut the text and are never streamed, even in part.
"""
from __future__ import annotations

import pytest

from actors.text import REPLACEMENT, TextStream, encode_prompt

TEXTS = ["Hello 🙂 world! 你好，世界。 Ünïcödé ✓ 🚀🚀 done",
         "日本語のテキストと絵文字 🎉🎊 を混ぜる",
         "def f(x):\n    return x ** 2  # ∑ 👍\n"]


@pytest.fixture(scope="module")
def tok(smollm2):
    return smollm2.tokenizer


def stream(tok, prompt, ids, block, stop=()):
    ts = TextStream(tok, prompt, stop)
    deltas, done = [], False
    for i in range(0, len(ids), block):
        chunk = ids[i:i + block]
        if stop:
            for t in chunk:
                if ts.push([t]):
                    done = True
                    break
        else:
            ts.push(chunk)
        last = done or i + block >= len(ids)
        deltas.append(ts.take(final=last))
        if done:
            break
    return deltas, ts


@pytest.mark.parametrize("block", [1, 3, 5])
@pytest.mark.parametrize("text", TEXTS, ids=["emoji-cjk", "japanese", "code"])
def test_stream_equals_full_decode_without_broken_characters(tok, text, block):
    prompt = encode_prompt(tok, prompt="Say:")
    ids = tok.encode(text, add_special_tokens=False)
    assert any(REPLACEMENT in tok.decode([t]) for t in ids)  # characters really are split across tokens
    deltas, ts = stream(tok, prompt, ids, block)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == ts.text
    assert all(REPLACEMENT not in d for d in deltas)


def test_output_cut_inside_a_character_ends_as_a_full_decode_does(tok):
    ids = tok.encode("ok 🙂", add_special_tokens=False)[:-1]  # the emoji's last byte never arrives
    deltas, _ = stream(tok, [], ids, 1)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    assert all(REPLACEMENT not in d for d in deltas[:-1])  # only the final flush may carry it


@pytest.mark.parametrize("stop", ["世界", "🚀🚀", "Ünï"])
def test_stop_string_cuts_and_is_never_streamed(tok, stop):
    text = TEXTS[0]
    ids = tok.encode(text, add_special_tokens=False)
    deltas, ts = stream(tok, [], ids, 1, stop=(stop,))
    assert ts.stop_string == stop
    assert "".join(deltas) == text[:text.index(stop)] == ts.text
    streamed = ""
    for d in deltas:  # at no point did the stream run ahead of the final text into the stop string
        streamed += d
        assert ts.text.startswith(streamed)


def test_work_per_token_is_bounded(tok):
    """O(new tokens) per push: the decoding window stays a few tokens long however long the
    output grows (the old code decoded the whole output every time)."""
    ids = tok.encode(" ".join(TEXTS * 20), add_special_tokens=False)
    ts = TextStream(tok, [], ())
    widest = 0
    for t in ids:
        ts.push([t])
        widest = max(widest, len(ts.ids) - ts.prefix)
        ts.take(final=False)
    assert len(ids) > 500 and widest <= 8
