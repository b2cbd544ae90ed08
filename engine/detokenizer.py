"""Incremental detokenisation with stop strings: text is released only when it is final.

Work per step is bounded by the step's tokens and the longest stop string, not by the
length of the output: with a fast tokenizer whose decode is a plain concatenation (no
clean-up of spaces) the text comes from `tokenizers.decoders.DecodeStream`, one token at a
time; only text that may still be needed (the unreleased tail and enough released text to
find a stop string that straddles it) is kept. Other tokenizers fall back to decoding the
whole output each step (test doubles, slow tokenizers).
"""
from __future__ import annotations


def _decode_stream(tokenizer):
    """A DecodeStream for `tokenizer` when it gives exactly its own decode, else None."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:  # tokenizers < 0.21
        return None
    return backend, DecodeStream(skip_special_tokens=True)


class IncrementalDetokenizer:
    """Turns committed token ids into text deltas that never change afterwards.

    Holds back (a) a trailing incomplete multi-byte character and (b) any text tail that
    could still become the start of a stop string, so neither a broken character nor the
    beginning of a stop string ever leaks to a stream. The text is the tokenizer's decode of
    all ids with special tokens skipped; after a stop string it is cut where the stop string
    begins (OpenAI semantics).
    """

    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tok = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.max_stop = max((len(s) for s in self.stop), default=0)
        self.ids: list[int] = []
        self.stopped = False
        self._stream = _decode_stream(tokenizer)
        # The text is text[:dropped] (released, no longer needed) + tail.
        self._dropped = 0
        self._tail = ""
        self._emitted = 0  # characters of the whole text already released
        self._pieces: list[str] = []  # text added by each token of the last `add` (stream path)

    # ---- text state ------------------------------------------------------------------------
    @property
    def text(self) -> str:
        """The text kept: all of it, except released text far behind (dropped on long outputs)."""
        return self._tail

    def _trim(self) -> None:
        """Drop released text older than the longest stop string (never searched again)."""
        keep_from = self._emitted - self.max_stop
        cut = keep_from - self._dropped
        if self._stream is not None and cut > 4096:
            self._tail = self._tail[cut:]
            self._dropped += cut

    # ---- decoding ----------------------------------------------------------------------------
    def _append(self, token_ids: list[int]) -> None:
        """Append tokens to ids and their text to the tail; record per-token pieces."""
        self.ids.extend(token_ids)
        if self._stream is None:
            self._tail = self.tok.decode(self.ids, skip_special_tokens=True)  # never trimmed on this path
            return
        backend, stream = self._stream
        pieces = []
        for t in token_ids:
            piece = stream.step(backend, t)
            pieces.append(piece or "")
        self._pieces = pieces
        self._tail += "".join(pieces)

    def _text_after(self, base_len: int, base_ids: int, k: int) -> str:
        """The tail as it was after the first k tokens of the last `add` (rare stop-string path).

        base_len: tail length before the add; base_ids: len(ids) before it.
        """
        if self._stream is None:
            return self.tok.decode(self.ids[: base_ids + k], skip_special_tokens=True)
        return self._tail[:base_len] + "".join(self._pieces[:k])

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
        base_ids, base_len = len(self.ids), len(self._tail)
        self._append(token_ids)
        if not self.stop:
            self._trim()
            return len(token_ids)
        lo = max(0, self._emitted - self.max_stop - self._dropped)
        if self._find_stop(self._tail, lo) < 0:
            self._trim()
            return len(token_ids)
        # Rare path: find the first token whose addition completes the stop string.
        for k in range(1, len(token_ids) + 1):
            text = self._text_after(base_len, base_ids, k)
            at = self._find_stop(text, lo)
            if at >= 0:
                self.ids = self.ids[: base_ids + k]
                self._tail = text[:at]
                self.stopped = True
                return k
        raise AssertionError("stop string found in the whole text but in no prefix")  # unreachable

    def release(self, final: bool = False) -> str:
        """Return the next safe text delta; with final=True, everything left."""
        tail, off = self._tail, self._dropped
        end = off + len(tail)
        if not final and not self.stopped:
            while end > self._emitted and tail[end - off - 1] == "\ufffd":
                end -= 1
            # Keep back the longest tail that is a proper prefix of some stop string.
            for k in range(min(self.max_stop - 1, end - self._emitted), 0, -1):
                piece = tail[end - off - k: end - off]
                if any(s.startswith(piece) for s in self.stop):
                    end -= k
                    break
        if end <= self._emitted:
            return ""
        delta = tail[self._emitted - off: end - off]
        self._emitted = end
        return delta
