"""Prompts to token ids, and token ids back to text incrementally (UTF-8 safe, stop strings)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from compiled_engine.models.demo import cache_root, cached_folder
from compiled_engine.models.gguf_checkpoint import is_gguf, open_gguf

Prompt = str | list[int] | list[dict]


def load_tokenizer(model_path: str):
    """The tokenizer of a checkpoint directory, or of a GGUF file (with its chat template)."""
    from transformers import AutoTokenizer

    if is_gguf(model_path):
        return AutoTokenizer.from_pretrained(gguf_tokenizer_dir(Path(model_path)))
    return AutoTokenizer.from_pretrained(model_path)


def gguf_tokenizer_dir(gguf: Path) -> Path:
    """The tokenizer that transformers converts from a GGUF file's vocabulary (seconds for a 49k-token BPE
    vocabulary), saved once under the cache root, keyed by what it is converted from."""
    from transformers import AutoTokenizer

    def convert(out: Path) -> None:
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(out))

    digest = open_gguf(gguf).tokenizer_digest
    return cached_folder(cache_root() / "gguf-tokenizers" / digest, convert, "tokenizer_config.json")


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    """A string, a list of token ids, or chat messages (the chat template adds BOS itself: no double BOS)."""
    if isinstance(prompt, str):
        return tokenizer(prompt).input_ids
    if prompt and all(isinstance(m, dict) for m in prompt):
        return encode_chat(tokenizer, prompt)
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise ValueError("prompt must be a string, a list of token ids or a list of chat messages")


def encode_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                tools: list[dict] | None = None) -> list[int]:
    """The chat template's prompt ids; `tools` (OpenAI function tools) go to the template too."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model's tokenizer has no chat template; use a completion prompt")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         tools=tools)
    return tokenizer(text, add_special_tokens=False).input_ids


@dataclass
class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that never split a UTF-8 character, and finds
    stop strings (the text up to a stop string is emitted; the stop string is not)."""

    tokenizer: object
    prompt_ids: list[int] = field(default_factory=list)
    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    ids: list[int] = field(default_factory=list)
    text: str = ""  # emitted so far
    stopped: bool = False
    _prefix_offset: int = 0
    _read_offset: int = 0
    _held: str = ""  # decoded but withheld: it may be the start of a stop string

    def __post_init__(self) -> None:
        # Decode with a few prompt tokens as left context, so the first token gets its leading space right.
        self.ids = list(self.prompt_ids[-4:])
        self._prefix_offset = 0
        self._read_offset = len(self.ids)

    def add(self, token_id: int) -> str:
        """Feed one token; returns the new text (possibly empty)."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)  # noqa: E731
        prefix = decode(self.ids[self._prefix_offset:self._read_offset])
        full = decode(self.ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # an incomplete character: wait for more bytes
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
                cut = min(i for i, _ in hits)
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
