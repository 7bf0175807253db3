"""`compiled-engine chat`: an interactive chat in this process."""

from __future__ import annotations

import argparse
import itertools
import sys

from compiled_engine.engine_args import engine_config
from compiled_engine.models.demo import DEMO_LABEL, DEMO_NAME


def run_chat(args: argparse.Namespace) -> int:
    """Interactive chat in this process, streaming tokens; `/reset` clears the history, `/exit`
    quits."""
    from compiled_engine.llm import LLM
    from compiled_engine.sampling_params import SamplingParams
    from compiled_engine.tokenization import IncrementalDetokenizer, encode_chat

    config = engine_config(args)
    if config.model == DEMO_NAME:
        print(f"[{DEMO_LABEL}]", file=sys.stderr)
    llm = LLM(**vars(config))
    history: list[dict] = []
    print("chat: type a message; /reset clears the conversation, /exit quits", file=sys.stderr)
    for turn in itertools.count():
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if line == "/exit":
            break
        if line == "/reset":
            history.clear()
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        ids = encode_chat(llm.tokenizer, history)
        rid = f"chat-{turn}"
        llm.engine.add_request(
            rid, ids, SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
        )
        detok = IncrementalDetokenizer(llm.tokenizer, ids)
        while llm.engine.has_work():
            for ev in llm.engine.step():
                if ev.token is not None:
                    print(detok.add(ev.token), end="", flush=True)
                if ev.finished:
                    print(detok.flush(), flush=True)
        history.append({"role": "assistant", "content": detok.text})
    return 0
