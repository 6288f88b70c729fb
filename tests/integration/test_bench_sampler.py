"""`tandem bench sampler` end to end on the bundled model: the host's top-p by candidates keeps
the tokens a sort of the whole row keeps, and the compiled draw chooses the torch ops' token, on
real next-token logits (the bench checks each row); the CPU engine decodes the same tokens all
three ways."""

from __future__ import annotations

import argparse

from bench import sampler as bench_sampler


def test_the_sampler_bench_prints_both_tables_and_the_same_tokens(capsys):
    assert bench_sampler.main(argparse.Namespace(tokens=3, rounds=1)) == 0
    out = capsys.readouterr().out
    assert ("| T | top-p | tokens kept | top-p: full sort µs | candidates µs | ratio | whole choice: torch ops µs "
            "| compiled µs | ratio |") in out
    rows = [line for line in out.splitlines() if " stream" in line and line.startswith("| ")]
    assert len(rows) == 4 and all(line.count("| yes |") == 2 for line in rows), out
