"""Text in and out: prompt encoding, and incremental detokenisation with stop strings.

`encode_prompt` turns a plain prompt or chat messages (through the model's chat
template) into token ids. `TextStream` turns a sequence's committed tokens into text,
O(new tokens) per step: it decodes only a short window of trailing tokens, emits the
text that window added once it ends on a complete character (byte-level tokenizers
split UTF-8 characters across tokens), finds stop strings in the new text, and holds
back a tail that may still become a stop string, so neither a broken character nor
the start of a stop string is ever streamed.

Does not know: models, sampling or requests beyond their stop strings.
"""
from __future__ import annotations

from .schema import validate_messages

REPLACEMENT = "\ufffd"  # what a decoder yields for an incomplete UTF-8 sequence


def encode_prompt(tokenizer, prompt: str | None = None, messages: list | None = None) -> list[int]:
    """Token ids for a plain prompt, or for chat messages with the generation prompt appended."""
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt or messages")
    if tokenizer is None:
        raise ValueError("this model has no tokenizer: pass token ids")
    if messages is not None:
        msgs = validate_messages(messages)
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    if not prompt:
        raise ValueError("prompt must not be empty")
    return tokenizer.encode(prompt, add_special_tokens=False)


class TextStream:
    """The output text of one sequence, built incrementally.

    `push(tokens)` appends committed tokens and returns True when a stop string appeared
    (call it one token at a time when stop strings are set, so generation ends at the
    token that completed it). `take(final)` returns the text not yet emitted: all of it
    when final, else what can no longer turn into a stop string. `text` is the output
    text so far, cut before a stop string once one matched.

    Decoding window: tokens[prefix:] is decoded each time; `prefix_text` is the decode of
    tokens[prefix:read], whose text has been appended already. A few prompt tokens seed the
    window so tokenizers that drop a leading space on a lone token decode the first output
    token as they would in context.
    """

    CONTEXT = 4  # prompt tokens that seed the window

    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...] = ()):
        self.tok, self.stop = tokenizer, stop
        self.ids = list(prompt_ids[-self.CONTEXT:])
        self.prefix, self.read = 0, len(self.ids)
        self.prefix_text = self._decode(self.ids) if self.ids else ""
        self.text = ""  # stable output text
        self.sent = 0  # characters of `text` already emitted
        self.stop_at: int | None = None  # where the matched stop string starts in `text`
        self.stop_string: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def push(self, tokens: list[int]) -> bool:
        self.ids.extend(tokens)
        window = self._decode(self.ids[self.prefix:])
        if len(window) <= len(self.prefix_text) or window.endswith(REPLACEMENT):
            return False  # nothing new, or an incomplete character: wait for the next token
        old = len(self.text)
        self.text += window[len(self.prefix_text):]
        self.prefix, self.read = self.read, len(self.ids)
        self.prefix_text = self._decode(self.ids[self.prefix:self.read])
        return self._find_stop(old)

    def _find_stop(self, old: int) -> bool:
        if not self.stop or self.stop_at is not None:
            return self.stop_at is not None
        best = None
        for s in self.stop:
            i = self.text.find(s, max(0, old - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        self.stop_at, self.stop_string = best
        self.text = self.text[:self.stop_at]
        return True

    def take(self, final: bool) -> str:
        if final and self.stop_at is None:
            # Flush what the window still holds (an output that ends inside a character
            # decodes with a replacement character, as a full decode would).
            tail = self._decode(self.ids[self.prefix:])[len(self.prefix_text):]
            self.prefix = self.read = len(self.ids)
            self.prefix_text = ""
            self.text += tail
        end = len(self.text)
        if not final and self.stop_at is None:
            end -= self._held()
        delta = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return delta

    def _held(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        return max((k for s in self.stop for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
