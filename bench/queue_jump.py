"""A short prompt behind long ones of its tier: ``python -m bench.queue_jump --url URL``.

Each round sends ``--longs`` long chats (``--long-tokens`` tokens of docs/kernels.md each, 8
tokens out) at once, then, ``--gap`` s later, one short chat of the same tier, all streamed,
and records each request's TTFT. On a stack whose prefill worker (or colocated decode worker)
queues the long prompts, the short chat waits for whatever the engine's scheduler lets it pass
(docs/routing.md: a long prompt leaves half its step to the short prompts of its tier). Prints
each round and the medians; ``--json FILE`` keeps them. Any OpenAI-compatible server works; each
round's prompts start with the round's tag, so no prompt reuses another round's cached prefix
beyond the chat template."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

SHORT = ("A farmer has three fields. The first grows wheat, the second barley and the third oats. "
         "Each autumn he rotates them so that no field grows the same crop twice in a row. Which crop "
         "grows in the first field in the third year, and why does rotation help the soil?")


async def _ttft(client, model: str, content: str, tier: str) -> float:
    t0 = time.monotonic()
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=8, temperature=0,
        stream=True, extra_body={"ignore_eos": True, "tier": tier})
    ttft = None
    async for chunk in stream:
        if ttft is None and chunk.choices and chunk.choices[0].delta.content:
            ttft = time.monotonic() - t0
    if ttft is None:
        raise RuntimeError("a stream ended without content")
    return ttft


async def run(url: str, rounds: int, longs: int, long_tokens: int, gap: float, tier: str, short: str = SHORT) -> dict:
    from openai import AsyncOpenAI
    client = AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key="none", max_retries=0, timeout=900)
    model = (await client.models.list()).data[0].id
    text = (Path(__file__).resolve().parents[1] / "docs" / "kernels.md").read_text()
    chars = long_tokens * 4   # ~4 characters a token in this text
    out = {"short": [], "long": []}
    for r in range(rounds):
        tasks = [asyncio.create_task(_ttft(client, model, f"[{r}.{i}] " + text[i * 500:i * 500 + chars]
                                           + "\nSummarise the text above.", tier)) for i in range(longs)]
        await asyncio.sleep(gap)
        first = await _ttft(client, model, f"[{r}] {short}", tier)
        long = await asyncio.gather(*tasks)
        out["short"].append(first)
        out["long"] += long
        print(f"round {r + 1}: short TTFT {first:.2f} s; long TTFTs " + " ".join(f"{x:.2f}" for x in long), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.queue_jump", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--longs", type=int, default=3, help="long prompts a round (default 3)")
    p.add_argument("--long-tokens", type=int, default=2000, help="about this many tokens each (default 2000)")
    p.add_argument("--gap", type=float, default=0.3, help="seconds between the long prompts and the short one")
    p.add_argument("--tier", default="batch", help="every prompt's tier (default batch)")
    p.add_argument("--short", default=SHORT, help="the short chat's question (default: ~60 tokens)")
    p.add_argument("--json", default=None, help="write the TTFTs here")
    a = p.parse_args(argv)
    out = asyncio.run(run(a.url, a.rounds, a.longs, a.long_tokens, a.gap, a.tier, a.short))
    print(f"short TTFT median {statistics.median(out['short']):.2f} s ({len(out['short'])} rounds); "
          f"long TTFT median {statistics.median(out['long']):.2f} s")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
