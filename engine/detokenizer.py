"""Incremental detokenisation with stop strings: text is released only when it is final."""
from __future__ import annotations


class IncrementalDetokenizer:
    """Turns committed token ids into text deltas that never change afterwards.

    Holds back (a) a trailing incomplete multi-byte character (decoded as U+FFFD) and
    (b) any text tail that could still become the start of a stop string, so neither
    a broken character nor the beginning of a stop string ever leaks to a stream.
    The text is the tokenizer's decode of all ids with special tokens skipped; after a
    stop string it is cut where the stop string begins (OpenAI semantics).
    """

    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tok = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.max_stop = max((len(s) for s in self.stop), default=0)
        self.ids: list[int] = []
        self.text = ""
        self.emitted = 0  # characters of self.text already released
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def _find_stop(self, text: str, lo: int) -> int:
        hits = [i for i in (text.find(s, lo) for s in self.stop) if i >= 0]
        return min(hits) if hits else -1

    def add(self, token_ids: list[int]) -> int:
        """Append tokens; return how many of them were kept.

        Without a stop string all are kept. When a stop string completes, only the
        tokens up to the one completing it are kept, the text is cut at the stop
        string's start and `stopped` becomes True.
        """
        if self.stopped:
            return 0
        base = len(self.ids)
        self.ids.extend(token_ids)
        self.text = self._decode(self.ids)
        if not self.stop:
            return len(token_ids)
        lo = max(0, self.emitted - self.max_stop)
        at = self._find_stop(self.text, lo)
        if at < 0:
            return len(token_ids)
        # Rare path: find the first token whose addition completes the stop string.
        for k in range(1, len(token_ids) + 1):
            text = self._decode(self.ids[: base + k])
            at = self._find_stop(text, lo)
            if at >= 0:
                self.ids = self.ids[: base + k]
                self.text = text[:at]
                self.stopped = True
                return k
        raise AssertionError("stop string found in the whole text but in no prefix")  # unreachable

    def release(self, final: bool = False) -> str:
        """Return the next safe text delta; with final=True, everything left."""
        end = len(self.text)
        if not final and not self.stopped:
            while end > self.emitted and self.text[end - 1] == "\ufffd":
                end -= 1
            # Keep back the longest tail that is a proper prefix of some stop string.
            for k in range(min(self.max_stop - 1, end - self.emitted), 0, -1):
                tail = self.text[end - k : end]
                if any(s.startswith(tail) for s in self.stop):
                    end -= k
                    break
        if end <= self.emitted:
            return ""
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
