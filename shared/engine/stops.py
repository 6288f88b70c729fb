"""Stop strings, matched in time linear in the text a sequence generates.

Each step a sequence's new text is fed to its ``StopMatcher``. One Knuth-Morris-Pratt automaton
per stop string keeps its state across steps: ``k`` = the length of the longest tail of the text
so far that is a prefix of the stop string. So a step costs O(new characters x stop strings),
amortized, whatever the lengths of the text and of the stop strings — no rescanning of a window,
no slicing. Two numbers fall out:

- a stop string is found when some ``k`` reaches its length (the text ends with it);
- ``holdback`` = the largest ``k``: the tail that may still grow into a stop string, which the
  engine holds back from the client until it is sure it is not one.

The failure table of each stop string is built lazily, an entry when ``k`` first reaches it, so
a sequence pays for a 30 KB stop string only as far as its text actually matches it (16 stop
strings of 30 KB cost nothing at admission).

The first stop string to complete ends the text (as if it arrived one character at a time), cut
where that stop string starts; when two complete at the same character the longer wins (it
starts first). Only the text after what was handed to the client can hold a stop string's
start (the rest was never held back), so a matcher built for a sequence that ran elsewhere
(hand-off, migration, resume) is primed with that tail alone.
"""

from __future__ import annotations


class _Automaton:
    """KMP over one stop string: ``k`` characters of it end the text fed so far."""

    __slots__ = ("s", "fail", "k")

    def __init__(self, s: str):
        self.s = s
        self.fail = [0]  # fail[i]: longest proper border of s[:i + 1], built up to index k - 1
        self.k = 0

    def step(self, c: str) -> bool:
        """Feed one character; True when the text now ends with the whole stop string."""
        s, fail, k = self.s, self.fail, self.k
        while k and s[k] != c:
            k = fail[k - 1]
        if s[k] == c:
            k += 1
            if len(fail) < k:  # k grew by one: the entry it falls back through on a mismatch
                self._extend()
            if k == len(s):  # found; go on as after its border (matches may overlap)
                self.k = fail[k - 1]
                return True
        self.k = k
        return False

    def _extend(self) -> None:
        """Append fail[j], j = len(fail) (needs fail[:j]; the classic prefix-function step)."""
        s, fail = self.s, self.fail
        j = len(fail)
        t = fail[j - 1]
        while t and s[j] != s[t]:
            t = fail[t - 1]
        fail.append(t + 1 if s[j] == s[t] else t)


class StopMatcher:
    """The stop strings of one sequence, fed its text piece by piece (module doc)."""

    __slots__ = ("_autos",)

    def __init__(self, stops: list[str], text: str = ""):
        """``text``: the part of the output already generated that was not handed out yet."""
        self._autos = [_Automaton(s) for s in stops]
        for c in text:
            for a in self._autos:
                a.step(c)

    def feed(self, new: str) -> int:
        """Feed the text new in this step. 0: no stop string; else how many characters to cut
        from the end of the whole text, so it ends just before the first stop string to complete."""
        for i, c in enumerate(new):
            done = [len(a.s) for a in self._autos if a.step(c)]
            if done:
                return len(new) - i - 1 + max(done)
        return 0

    @property
    def holdback(self) -> int:
        """Characters at the end of the text that may still grow into a stop string."""
        return max((a.k for a in self._autos), default=0)
