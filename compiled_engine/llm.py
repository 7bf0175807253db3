"""The offline API: `LLM(model).generate(prompts, params)`, on the same engine as the server."""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass, field

from tqdm import tqdm

from compiled_engine.config import EngineConfig
from compiled_engine.lora.request import LoRARequest
from compiled_engine.models.names import resolve_model
from compiled_engine.output_stream import OutputStream
from compiled_engine.sampling_params import SamplingParams, expand_n
from compiled_engine.scheduler.plan import PromptLogprob
from compiled_engine.startup import build_engine
from compiled_engine.tokenization import (
    IncrementalDetokenizer,
    Prompt,
    encode_chat,
    encode_prompt,
    load_tokenizer,
)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    error: str | None = None  # finish_reason "error": why (a logits processor failed)


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    # with SamplingParams.prompt_logprobs: per prompt token (None for the first, which has no
    # context), its log-prob given the tokens before it, its rank and the most likely tokens there
    prompt_logprobs: list[PromptLogprob | None] | None = None
    embedding: list[float] | None = None  # with SamplingParams.pooling (`LLM.embed`)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


class LLM:
    """`LLM("demo").generate(["Hello"], SamplingParams(max_tokens=8))`; keyword arguments are
    `EngineConfig` fields (enforce_eager, overlap, page_size, num_pages, prefix_cache, tp_size,
    ...). With `tp_size > 1` the engine runs in that many rank processes (stopped by
    `engine.shutdown()` or at exit)."""

    def __init__(self, model: str = "demo", **kwargs) -> None:
        self.config = EngineConfig(model=model, **kwargs)
        self.tokenizer = load_tokenizer(resolve_model(model))
        if self.config.tp_size > 1:
            from compiled_engine.ranks.remote_engine import RemoteEngine

            self.engine = RemoteEngine(self.config)
            weakref.finalize(self, self.engine.shutdown)
        else:
            self.engine = build_engine(self.config)
        self._next_id = 0

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        *,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """`generate` over conversations, like vLLM's `LLM.chat`: one conversation (a list of
        messages) or a list of them, each through the model's chat template (with `tools`, OpenAI
        function tools, and `chat_template_kwargs`, the template's own variables); one output per
        conversation. Messages go to the template as given: content a string, a tool call's
        arguments an object (the server converts OpenAI's shapes; this does not). The model's
        tool calls stay text here (the server parses them)."""
        one = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if one else messages
        if not conversations or not all(
            isinstance(c, list) and c and all(isinstance(m, dict) for m in c)
            for c in conversations
        ):
            raise ValueError("chat: messages must be a conversation (a non-empty list of message "
                             "dicts) or a list of conversations")
        prompts = [
            encode_chat(self.tokenizer, c, add_generation_prompt, tools, chat_template_kwargs)
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def embed(self, prompts: Prompt | list[Prompt], pooling: str = "last",
              use_tqdm: bool | None = None) -> list[list[float]]:
        """Each prompt's embedding: the final hidden state of its last token ("last") or the mean
        over its tokens ("mean"), L2-normalized; prefill-only requests through the same
        scheduler."""
        params = SamplingParams(max_tokens=0, pooling=pooling)
        return [r.embedding for r in self.generate(prompts, params, use_tqdm)]

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """`lora_request`: the adapter of every prompt, or one per prompt (None: the base model),
        read on first use (the engine needs `enable_lora`); `priority`: each prompt's (vLLM's:
        lower is sooner; the engine needs `scheduling_policy="priority"`), over its params'."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], (int, dict))):
            prompts = [prompts]
        params_list = (
            params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        )
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} sampling params")
        if priority is not None:
            if len(priority) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(priority)} priorities")
            params_list = [dataclasses.replace(p, priority=level)
                           for p, level in zip(params_list, priority)]
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(loras)} LoRA requests")
        for lora in dict.fromkeys(r for r in loras if r is not None):
            self._serve_adapter(lora)
        results: list[RequestOutput] = []
        streams: dict[str, OutputStream] = {}
        bar = None
        # A bad prompt, or a request the ranks reject (tp > 1), fails the whole call, and leaves
        # nothing queued or running.
        try:
            for prompt, p, lora in zip(prompts, params_list, loras):
                ids = encode_prompt(self.tokenizer, prompt)
                results.append(RequestOutput(prompt_token_ids=ids))
                name = None if lora is None else lora.lora_name
                # the KV tier's pages of its prompt
                host = self.engine.read_tier(ids, name, p.cache_salt)
                for sample in expand_n(p):
                    rid = f"llm-{self._next_id}"
                    self._next_id += 1
                    self.engine.add_request(rid, ids, sample, lora_name=name, host=host)
                    streams[rid] = OutputStream(
                        rid, IncrementalDetokenizer(
                            self.tokenizer, ids, tuple(p.stop),
                            keep_stop=p.include_stop_str_in_output,
                        )
                    )
            show = use_tqdm if use_tqdm is not None else len(streams) >= 32
            bar = tqdm(total=len(streams), desc="generate", disable=not show)
            while self.engine.has_work():
                for ev in self.engine.step():
                    stream = streams[ev.rid]
                    was_open = stream.finish_reason is None
                    _, stopped = stream.apply(ev)
                    if stopped:
                        self.engine.finish(ev.rid, "stop")
                    if was_open and stream.finish_reason is not None:
                        bar.update()
        except Exception:
            for rid, stream in streams.items():
                if stream.finish_reason is None:
                    self.engine.abort(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        ordered = iter(streams.values())
        for result, p in zip(results, params_list):
            for i in range(p.n):
                stream = next(ordered)
                if i == 0:
                    if p.prompt_logprobs is not None:
                        result.prompt_logprobs = [None, *(stream.prompt_logprobs or [])]
                    result.embedding = stream.embedding
                result.outputs.append(
                    CompletionOutput(
                        i,
                        stream.text,
                        stream.token_ids,
                        stream.finish_reason,
                        stream.logprobs if p.logprobs is not None else None,
                        stream.top_logprobs if p.logprobs else None,
                        stream.error,
                    )
                )
        return results

    def _serve_adapter(self, lora: LoRARequest) -> None:
        """Load a request's adapter on first use (ValueError when another one has its name)."""
        loaded = self.engine.lora_paths()
        if lora.lora_name not in loaded:
            self.engine.add_lora(lora.lora_name, lora.lora_path)
        elif loaded[lora.lora_name] != str(lora.lora_path):
            raise ValueError(f"adapter {lora.lora_name!r} is loaded from "
                             f"{loaded[lora.lora_name]!r}, not {lora.lora_path!r}")
