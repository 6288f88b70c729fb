"""Stop-string matching (shared/engine/stops.py) against a brute-force reference."""

from __future__ import annotations

import random

from shared.engine.stops import StopMatcher


def reference(text: str, stops: list[str]) -> tuple[int, int]:
    """(end of the text kept, holdback) by brute force: the first stop string to complete (the
    longer on a tie) cuts the text where it starts; else the longest tail that is a proper
    prefix of a stop string is held back."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            return end - max(map(len, done)), 0
    hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return len(text), hold


def run(pieces: list[str], stops: list[str], prime: int = 0) -> tuple[int, int]:
    """Feed ``pieces`` (the first ``prime`` of them given at construction, as after a hand-off)."""
    text = "".join(pieces[:prime])
    m = StopMatcher(stops, text)
    for piece in pieces[prime:]:
        text += piece
        cut = m.feed(piece)
        if cut:
            return len(text) - cut, 0
    return len(text), m.holdback


def test_matches_the_reference_on_random_texts():
    rng = random.Random(7)
    for _ in range(3000):
        alphabet = "ab" if rng.random() < 0.5 else "abc"
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4))]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 8))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        want = reference(text, stops)
        assert run(pieces, stops) == want, (stops, pieces)


def test_a_primed_matcher_continues_where_the_first_stopped():
    """Built from the tail not yet handed out (a hand-off or resume), it goes on as one fed all along."""
    stops = ["abcab", "bcc"]
    pieces = ["xab", "ca", "b"]
    assert run(pieces, stops) == run(pieces, stops, prime=2) == (1, 0)
    assert StopMatcher(stops, "abca").holdback == 4


def test_overlapping_prefixes_and_ties():
    assert run(["aaab"], ["aab"]) == (1, 0)           # the automaton falls back, not to 0
    assert run(["xbcd"], ["bcd", "cd"]) == (1, 0)      # a tie: the longer one starts first
    assert run(["xabcd"], ["bc", "abcd"]) == (2, 0)    # the first to complete wins
    assert run(["ab", "c"], ["abd"]) == (3, 0)         # held back, then released
    m = StopMatcher(["abd"])
    m.feed("ab")
    assert m.holdback == 2


def test_long_stop_strings_cost_only_what_the_text_matches():
    """16 stop strings of 30 KB: the failure tables grow only as far as the text matched them."""
    rng = random.Random(1)
    stops = ["".join(rng.choice("0123456789") for _ in range(30_000)) for _ in range(16)]
    m = StopMatcher(stops)
    for _ in range(2000):
        assert m.feed("the quick brown fox ") == 0
    assert m.holdback == 0
    assert max(len(a.fail) for a in m._autos) == 1
    assert m.feed(stops[3][:50]) == 0 and m.holdback == 50
    assert m.feed(stops[3][50:]) == 30_000
