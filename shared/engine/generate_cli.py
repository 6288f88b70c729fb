"""``tandem generate "prompt"``: stream a completion from an engine in this process."""

from __future__ import annotations

import argparse
import sys

from shared.engine.engine import Engine, EngineConfig
from shared.engine.sampling import SamplingParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt text (a user message with --chat)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens at most (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default="cpu", help="cpu | cuda (default cpu)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")
    p.add_argument("--model", default=None, help="GGUF file or HF safetensors dir (default: bundled SmolLM2-135M)")


def main(args: argparse.Namespace) -> int:
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed).validate()
        engine = Engine.from_path(args.model, EngineConfig(device=args.device, threads=args.threads))
    except ValueError as e:
        print(f"tandem generate: {e}", file=sys.stderr)
        return 2
    tok = engine.tokenizer
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)
    else:
        ids = tok.encode(args.prompt)
    try:
        engine.add("cli", ids, params)
    except ValueError as e:
        print(f"tandem generate: {e}", file=sys.stderr)
        return 2
    done = False
    while not done:
        for out in engine.step():
            sys.stdout.write(out.text)
            sys.stdout.flush()
            done = out.finished
    sys.stdout.write("\n")
    return 0
