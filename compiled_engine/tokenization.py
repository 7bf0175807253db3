"""Prompts to token ids, and token ids back to text incrementally (UTF-8 safe, stop strings)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from compiled_engine.models.demo import cache_root, cached_folder
from compiled_engine.models.errors import CheckpointError
from compiled_engine.models.gguf_checkpoint import is_gguf, open_gguf

Prompt = str | list[int] | list[dict]


def load_tokenizer(model_path: str):
    """The tokenizer of a checkpoint directory, or of a GGUF file (with its chat template). Loading
    imports no torch (the server's process never does) where the checkpoint has a tokenizer.json and
    names a class of transformers' tokenizers backend; anything else goes through AutoTokenizer."""
    directory = gguf_tokenizer_dir(Path(model_path)) if is_gguf(model_path) else Path(model_path)
    return _tokenizer_class(directory).from_pretrained(str(directory))


def _tokenizer_class(directory: Path) -> type:
    """The class AutoTokenizer picks for a tokenizer.json whose tokenizer_config.json names it (with
    or without its `Fast` suffix), found without AutoTokenizer, which imports torch; else
    AutoTokenizer."""
    import transformers

    try:
        name = json.loads((directory / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        name = None
    if isinstance(name, str) and (directory / "tokenizer.json").is_file():
        for candidate in (name.removesuffix("Fast"), name):
            cls = getattr(transformers, candidate, None)
            if isinstance(cls, type) and issubclass(cls, transformers.TokenizersBackend):
                return cls
    return transformers.AutoTokenizer


def gguf_tokenizer_dir(gguf: Path) -> Path:
    """The tokenizer that transformers converts from a GGUF file's vocabulary (seconds for a
    49k-token BPE vocabulary), saved once under the cache root, keyed by what it is converted from.
    The conversion runs in a child interpreter: it imports torch, which the caller (the server) may
    not."""

    def convert(out: Path) -> None:
        done = subprocess.run(
            [sys.executable, "-c", _CONVERT, str(gguf.parent), gguf.name, str(out)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise CheckpointError(f"{gguf}: its tokenizer could not be converted: {last}")

    digest = open_gguf(gguf).tokenizer_digest
    return cached_folder(
        cache_root() / "gguf-tokenizers" / digest, convert, "tokenizer_config.json"
    )


_CONVERT = (
    "import sys; from transformers import AutoTokenizer; "
    "AutoTokenizer.from_pretrained(sys.argv[1], gguf_file=sys.argv[2]).save_pretrained(sys.argv[3])"
)


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    """A string, a list of token ids, or chat messages (the chat template adds BOS itself: no double
    BOS)."""
    if isinstance(prompt, str):
        return tokenizer(prompt).input_ids
    if prompt and all(isinstance(m, dict) for m in prompt):
        return encode_chat(tokenizer, prompt)
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise ValueError("prompt must be a string, a list of token ids or a list of chat messages")


def encode_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
    """The chat template's prompt ids; `tools` (OpenAI function tools) and `template_kwargs` (the
    template's own variables, e.g. `enable_thinking`) go to the template too."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model's tokenizer has no chat template; use a completion prompt")
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, tools=tools,
        **(template_kwargs or {}),
    )
    return tokenizer(text, add_special_tokens=False).input_ids


# Tokens an incomplete UTF-8 character may wait for (a character is at most 4 bytes); beyond that
# the bytes are invalid and go out as U+FFFD, so that each token decodes a bounded window.
MAX_WAIT_TOKENS = 8


@dataclass
class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that never split a UTF-8 character, and finds
    stop strings (the text up to a stop string is emitted; the stop string too with
    `keep_stop`)."""

    tokenizer: object
    prompt_ids: list[int] = field(default_factory=list)
    stop: tuple[str, ...] = ()
    keep_stop: bool = False
    skip_special_tokens: bool = True
    ids: list[int] = field(default_factory=list)
    text: str = ""  # emitted so far
    stopped: bool = False
    _prefix_offset: int = 0
    _read_offset: int = 0
    _held: str = ""  # decoded but withheld: it may be the start of a stop string

    def __post_init__(self) -> None:
        # Decode with a few prompt tokens as left context, so the first token gets its leading space
        # right.
        self.ids = list(self.prompt_ids[-4:])
        self._prefix_offset = 0
        self._read_offset = len(self.ids)

    def add(self, token_id: int) -> str:
        """Feed one token; returns the new text (possibly empty)."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        decode = lambda ids: self.tokenizer.decode(  # noqa: E731
            ids, skip_special_tokens=self.skip_special_tokens
        )
        prefix = decode(self.ids[self._prefix_offset:self._read_offset])
        full = decode(self.ids[self._prefix_offset:])
        waiting = len(self.ids) - self._read_offset
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and waiting < MAX_WAIT_TOKENS):
            return ""  # an incomplete character: wait for more bytes (a few tokens at most)
        new = full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        return self._emit(new)

    def flush(self) -> str:
        """At the end of the request: release text held back for a possible stop string."""
        out, self._held = self._held, ""
        if not self.stopped:
            self.text += out
        return out if not self.stopped else ""

    def _emit(self, new: str) -> str:
        pending = self._held + new
        if self.stop:
            hits = [(pending.find(s), s) for s in self.stop if s and s in pending]
            if hits:
                at, first = min(hits, key=lambda hit: hit[0])
                cut = at + len(first) if self.keep_stop else at
                self.stopped = True
                self._held = ""
                self.text += pending[:cut]
                return pending[:cut]
            keep = _longest_stop_prefix_suffix(pending, self.stop)
            out, self._held = pending[: len(pending) - keep], pending[len(pending) - keep:]
        else:
            out = pending
        self.text += out
        return out


def _longest_stop_prefix_suffix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
