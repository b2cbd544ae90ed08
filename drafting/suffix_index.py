"""Incremental suffix indices over token-id sequences for the suffix drafter.

Two structures:

* `SuffixAutomaton`: an online suffix automaton (Blumer et al. 1985) over one token
  sequence, with exact occurrence counts and most-recent end positions for every
  state that a bounded-length query can reach.
* `GlobalSuffixIndex`: a bounded index over the outputs of recently finished requests
  (oldest whole requests evicted first, size limit in tokens).

Notation. For a string S (a sequence of token ids) occurring in the indexed text T,
endpos(S) is the set of positions of T where an occurrence of S ends; the states of the
automaton are the classes of substrings with equal endpos. For a state u, len(u) is
the length of its longest string and minlen(u) = len(link(u)) + 1 the length of its
shortest one; link(u) is the suffix link.

Continuation counts. For a matched string S in state v and a token c, the number of
occurrences of S followed by c is occ(S c) = |endpos(delta(v, c))|, since all strings
of a state share endpos. These counts are kept in `occ[u]` ("endpos-set sizes"), so the
next-token distribution at any node of a candidate tree is read off the transitions of
the node's state with no rescans.

Counting horizon. Exact endpos sizes under online construction need a path update
along the suffix-link chain on every append, which can be long (e.g. a run of one
repeated token). We bound it with a horizon H: after appending position i we add i to
the states of the suffixes of T[:i+1] of length <= H only, i.e. the suffix-link chain
from the state holding the length-H suffix (tracked incrementally as `_win`) to the
root: at most H states, usually a handful. Because minlen never decreases as the text
grows, every state with minlen <= H has exact `occ` and `recent`; any query string of
length <= H lands in such a state. Choose H >= longest match + deepest continuation.

Costs: append is amortised O(1) for the automaton plus O(k) for the counts, where
k <= H is the number of distinct endpos classes among the last H suffixes. Memory is
about 2 states per token (a dict of transitions plus four list entries each, roughly
300-400 bytes per token in CPython).

Separators: negative token ids are reserved for separators (the global index puts
`SEPARATOR` between requests); they never appear in continuations.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

#: token id placed between requests in the global index; never proposed.
SEPARATOR = -1


class SuffixAutomaton:
    """Online suffix automaton over one token-id sequence, with bounded-horizon counts.

    horizon: H >= 1; occurrence counts (`occ`) and most recent end positions (`recent`)
    are exact for every string of length <= H (see the module docstring).
    tokens: initial text, appended in order.

    Public read-only attributes (lists indexed by state id; state 0 is the root, the
    empty string): `next` (dict token -> state), `link`, `length`, `occ` (number of
    end positions), `recent` (largest end position, 0-based; -1 for the root).
    `n` is the number of tokens appended.
    """

    __slots__ = ("horizon", "next", "link", "length", "occ", "recent", "n", "_last", "_win")

    def __init__(self, horizon: int = 64, tokens: Iterable[int] = ()) -> None:
        if horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {horizon}")
        self.horizon = int(horizon)
        self.next: list[dict[int, int]] = [{}]
        self.link: list[int] = [-1]
        self.length: list[int] = [0]
        self.occ: list[int] = [0]
        self.recent: list[int] = [-1]
        self.n = 0
        self._last = 0  # state of the whole text
        self._win = 0   # state of the suffix of length min(H, n)
        self.extend(tokens)

    @property
    def num_states(self) -> int:
        return len(self.length)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens in order (amortised O(1) each plus the bounded count update)."""
        for t in tokens:
            self.append(t)

    def append(self, c: int) -> None:
        """Append one token id `c` at position `self.n`."""
        nxt, link, ln, occ, recent = self.next, self.link, self.length, self.occ, self.recent
        H = self.horizon
        pos = self.n
        # x: state of the length-(H-1) suffix of the old text, when the new text is longer than H.
        x = -1
        if pos >= H:
            x = self._win
            if ln[link[x]] >= H - 1:
                x = link[x]

        cur = len(ln)
        nxt.append({})
        link.append(0)
        ln.append(ln[self._last] + 1)
        occ.append(0)
        recent.append(-1)
        p = self._last
        while p != -1 and c not in nxt[p]:
            nxt[p][c] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][c]
            if ln[p] + 1 == ln[q]:
                link[cur] = q
            else:
                clone = len(ln)
                nxt.append(dict(nxt[q]))
                link.append(link[q])
                ln.append(ln[p] + 1)
                occ.append(occ[q])
                recent.append(recent[q])
                while p != -1 and nxt[p].get(c) == q:
                    nxt[p][c] = clone
                    p = link[p]
                link[q] = clone
                link[cur] = clone
        self._last = cur
        self.n = pos + 1

        if x == -1:
            win = cur  # the whole text has length <= H
        else:
            # delta(x, c) holds the length-H suffix of the new text. If the split above
            # moved the length-(H-1) suffix from x = q into the clone, q lay on the
            # suffix path above p, so the first loop set q's c-transition to cur and the
            # clone copied it: both lead to cur, and x needs no adjustment.
            win = nxt[x][c]
        self._win = win
        w = win
        while w > 0:
            occ[w] += 1
            recent[w] = pos
            w = link[w]

    def match(self, window: Sequence[int]) -> tuple[int, int]:
        """Longest suffix of `window` that occurs in the text.

        window: token ids (for example the last M context tokens, root last).
        Returns (state, length): the state holding that suffix and its length
        (0 and 0 when even the last token never occurred). O(len(window)) amortised.
        """
        nxt, link, ln = self.next, self.link, self.length
        s = l = 0
        for t in window:
            while s and t not in nxt[s]:
                s = link[s]
                l = ln[s]
            d = nxt[s].get(t)
            if d is None:
                s = l = 0
            else:
                s = d
                l += 1
        return s, l

    def continuations(self, state: int) -> list[tuple[int, int, int, int]]:
        """Next tokens after the strings of `state`, as (token, count, recent, child_state).

        count: occurrences of S c in the text (exact when len(S) + 1 <= horizon);
        recent: 0-based end position of the most recent occurrence of S c.
        Separator tokens (negative ids) are skipped. Order is unspecified.
        """
        occ, recent = self.occ, self.recent
        return [(c, occ[w], recent[w], w) for c, w in self.next[state].items() if c >= 0]


class GlobalSuffixIndex:
    """Bounded suffix index over the outputs of recently finished requests.

    One `SuffixAutomaton` over the concatenation out_1 SEP out_2 SEP ... (SEP =
    `SEPARATOR`), so no match or continuation crosses a request boundary.

    max_tokens: size limit in request tokens (separators not counted); > 0.
    horizon: as for `SuffixAutomaton`.
    low_water: fraction of max_tokens to evict down to when an addition would exceed the
      limit (0 < low_water <= 1). Eviction removes whole requests, oldest first
      (least recently added), then rebuilds the automaton from the survivors; evicting
      to a low-water mark makes rebuilds amortise to O(1 / (1 - low_water)) work per
      added token. Additions that fit are appended incrementally.

    `version` increases on every change, so callers can tell when a cached match is stale.
    Not thread-safe; the engine calls it from its single step loop.
    """

    def __init__(self, max_tokens: int, horizon: int = 64, low_water: float = 0.75) -> None:
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
        if not 0.0 < low_water <= 1.0:
            raise ValueError(f"low_water must be in (0, 1], got {low_water}")
        self.max_tokens = int(max_tokens)
        self.horizon = int(horizon)
        self.low_water = float(low_water)
        self.automaton = SuffixAutomaton(self.horizon)
        self._requests: OrderedDict[int, list[int]] = OrderedDict()
        self._next_id = 0
        self.total_tokens = 0
        self.version = 0
        self.rebuilds = 0

    def __len__(self) -> int:
        return len(self._requests)

    def request_ids(self) -> list[int]:
        """Ids of the stored requests, oldest first."""
        return list(self._requests)

    def tokens(self, request_id: int) -> list[int]:
        return list(self._requests[request_id])

    def add(self, tokens: Sequence[int]) -> int | None:
        """Store one finished request's output; returns its id (None when empty).

        tokens: non-negative token ids. An output longer than max_tokens keeps its last
        max_tokens tokens. Raises ValueError on a negative id (reserved for separators).
        """
        toks = [int(t) for t in tokens][-self.max_tokens:]
        if not toks:
            return None
        if min(toks) < 0:
            raise ValueError("negative token ids are reserved for separators")
        rid = self._next_id
        self._next_id += 1
        if self.total_tokens + len(toks) > self.max_tokens:
            target = max(0, int(self.low_water * self.max_tokens) - len(toks))
            while self._requests and self.total_tokens > target:
                _, old = self._requests.popitem(last=False)
                self.total_tokens -= len(old)
            self._requests[rid] = toks
            self.total_tokens += len(toks)
            self._rebuild()
        else:
            self._requests[rid] = toks
            self.total_tokens += len(toks)
            self.automaton.extend(toks)
            self.automaton.append(SEPARATOR)
        self.version += 1
        return rid

    def _rebuild(self) -> None:
        sam = SuffixAutomaton(self.horizon)
        for toks in self._requests.values():
            sam.extend(toks)
            sam.append(SEPARATOR)
        self.automaton = sam
        self.rebuilds += 1
