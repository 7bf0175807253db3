"""The server's settings and what its handlers share."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from compiled_engine.config import EngineConfig
from compiled_engine.grammar_worker import MEMORY_BYTES
from compiled_engine.models.demo import DEMO_NAME
from compiled_engine.ranks.torchrun import TorchrunPlacement
from server.batch.runner import Batches
from server.engine_client import EngineClient
from server.grammar_check import GrammarChecker
from server.metrics import Metrics
from server.protocol import Limits
from server.reasoning import ReasoningParser
from server.request_errors import ProtocolError
from server.response_store import ResponseStore
from server.tools import parser_for_template


@dataclass
class ServerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    # the API keys the server takes (none: no key asked for); each key owns its Batch API objects
    api_keys: tuple[str, ...] = ()
    max_queue: int = 1024  # sequences in flight (waiting + running) before 429
    max_body_bytes: int = 4 * 2**20
    debug: bool = False  # exposes GET /debug/integrity
    # hermes | llama3_json | mistral; None: from the chat template
    tool_call_parser: str | None = None
    # qwen3 | deepseek_r1: the output's thinking span apart from its answer (server/reasoning.py)
    reasoning_parser: str | None = None
    # the chat template's variables for every request (a request's chat_template_kwargs win)
    default_chat_template_kwargs: dict = field(default_factory=dict)
    health_timeout_s: float = 10.0
    # after the engine fails: /health answers 503 this long, then the server exits
    engine_dead_exit_s: float = 10.0
    pooling: str = "last"  # /v1/embeddings: "last" | "mean" of the final hidden states
    # under torchrun (this process is its rank 0): the other engine ranks are torchrun's processes
    torchrun: TorchrunPlacement | None = None
    host: str = "127.0.0.1"  # the address served: a loopback one answers loopback Host names only
    allowed_hosts: tuple[str, ...] = ()  # Host names answered besides those
    send_timeout_s: float = 60.0  # a client that takes no data this long is dropped
    shutdown_timeout_s: float = 20.0  # on SIGTERM, how long requests in flight may still run
    read_timeout_s: float = 60.0  # a request body must arrive within this
    request_timeout_s: float | None = None  # a generation running longer is ended (None: no limit)
    grammar_compile_timeout_s: float = 10.0  # a constraint compiling longer is a 400
    grammar_compile_memory_bytes: int = MEMORY_BYTES  # a constraint needing more to compile: a 400
    # the Batch API's files and batches (None: under the user's state folder, store.state_root)
    batch_dir: str | None = None
    max_batch_file_bytes: int = 200 << 20  # an upload's size (OpenAI's limit)
    batch_disk_bytes: int = 10 << 30  # everything the Batch API keeps, together
    max_batch_output_bytes: int = 1 << 30  # a batch's answers (output and error files together)
    # LoRA adapters loaded and unloaded by clients (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING; off:
    # the four adapter routes answer 404), and the folder such loads are confined to (None: every
    # runtime load refused)
    allow_runtime_lora_updating: bool = False
    lora_dir: str | None = None
    # a batch's requests in flight at once (half of the grammar checker's queue: direct clients'
    # constraints keep the other half)
    batch_concurrency: int = 32


@dataclass
class ServerState:
    config: ServerConfig
    client: EngineClient
    tokenizer: object
    limits: Limits
    metrics: Metrics
    model_name: str  # the id /v1/models lists
    grammars: GrammarChecker  # each output constraint compiles here first, within a time budget
    created: int = field(default_factory=lambda: int(time.time()))
    responses: ResponseStore = field(default_factory=ResponseStore)  # /v1/responses' stored
    # the LoRA adapters served (name -> path), as the engine ranks have confirmed them
    adapters: dict[str, str] = field(default_factory=dict)
    reasoning: ReasoningParser | None = None  # --reasoning-parser
    batches: Batches | None = None  # the Batch API (server/batch)

    @property
    def model_names(self) -> tuple[str, ...]:
        """The names a request's `model` may give: the served id and, for a path, its last
        component."""
        tail = Path(self.model_name.rstrip("/")).name
        return (self.model_name,) if tail in ("", self.model_name) else (self.model_name, tail)

    def adapter_of(self, model: str | None) -> str | None:
        """The adapter a request's `model` names (vLLM: its name; SGLang: `base:name`), None for
        the base model; 404 in OpenAI's shape for a name this server does not serve."""
        if model is None or model in self.model_names:
            return None
        if model in self.adapters:
            return model
        base, sep, name = model.rpartition(":")
        if sep and base in self.model_names and name in self.adapters:
            return name
        served = ", ".join(repr(n) for n in (*self.model_names, *self.adapters))
        raise ProtocolError(f"the model '{model[:100]}' does not exist; this server serves "
                            f"{served}", "model", status=404, code="model_not_found")

    @property
    def tool_parser(self) -> str:
        return self.config.tool_call_parser or parser_for_template(
            getattr(self.tokenizer, "chat_template", None)
        )

    @property
    def is_demo(self) -> bool:
        return self.config.engine.model == DEMO_NAME
