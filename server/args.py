"""The server's command-line flags (`compiled-engine serve`, `python -m server`)."""

from __future__ import annotations

import argparse
import json
import os

from compiled_engine.engine_args import add_engine_args
from compiled_engine.grammar_worker import MEMORY_BYTES
from compiled_engine.sampling_params import POOLINGS
from server.batch.store import state_root
from server.protocol import ProtocolError, template_kwargs_of
from server.reasoning import ALIASES as REASONING_ALIASES
from server.reasoning import PARSERS as REASONING_PARSERS
from server.state import ServerConfig
from server.tools import PARSERS

API_KEY_ENV = "COMPILED_ENGINE_API_KEY"
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def resolve_api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """The API keys: --api-key-file's (one key a line, blank lines and lines starting with `#`
    left out), else --api-key's, else $COMPILED_ENGINE_API_KEY; none: the server asks for no
    key."""
    if args.api_key_file:
        with open(args.api_key_file, encoding="utf-8") as f:
            keys = tuple(dict.fromkeys(k for line in f
                                       if (k := line.strip()) and not k.startswith("#")))
        if not keys:
            raise OSError(f"{args.api_key_file} holds no key")
        return keys
    env = os.environ.get(API_KEY_ENV)
    return tuple(dict.fromkeys(args.api_key or ())) or ((env,) if env else ())


def runtime_lora_updating(args: argparse.Namespace) -> bool:
    """--allow-runtime-lora-updating, or $VLLM_ALLOW_RUNTIME_LORA_UPDATING read as vLLM reads it
    (`1` or `true`, any case)."""
    env = os.environ.get(RUNTIME_LORA_ENV, "0").strip().lower() in ("1", "true")
    return args.allow_runtime_lora_updating or env


def folder(text: str) -> str:
    """A folder flag's value: an existing directory, as its real path."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
    return os.path.realpath(text)


def seconds(text: str) -> float:
    """A timeout flag's value: a positive number of seconds."""
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"a timeout is a positive number of seconds, not {text}")
    return value


def _above_zero(parse, what: str):
    """An argparse type: `parse(text)` (int or float), finite and above 0; else `what` said."""
    def check(text: str):
        try:
            value = parse(text)
        except ValueError:
            value = 0
        if not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"{what} above 0, not {text!r}")
        return value
    return check


mebibytes = _above_zero(int, "a size in MiB is a whole number")  # a size flag's value in MiB
gibibytes = _above_zero(float, "a size in GiB is a number")  # a size flag's value in GiB


def template_kwargs(text: str) -> dict:
    """--default-chat-template-kwargs: a JSON object of the chat template's variables."""
    try:
        return template_kwargs_of(json.loads(text), "--default-chat-template-kwargs")
    except (ValueError, ProtocolError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_serve_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--allowed-hosts", nargs="+", default=None, metavar="NAME",
        help="Host header names answered besides the loopback ones of a loopback bind (with them "
             "set, any bind checks the Host)",
    )
    p.add_argument(
        "--api-key", default=None, nargs="+", metavar="KEY",
        help=f"require 'Authorization: Bearer KEY' (all but /health), KEY one of these; each key "
             f"owns its own Batch API files and batches; visible in ps: prefer ${API_KEY_ENV} "
             f"(one key) or --api-key-file",
    )
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="read the API keys from this file: one key a line, blank lines and "
                        "lines starting with # left out")
    p.add_argument("--max-queue", type=int, default=1024, help="sequences in flight before 429")
    p.add_argument("--send-timeout", type=seconds, default=60.0, metavar="SECONDS",
                   help="drop a client that takes no data for this long (its requests aborted)")
    p.add_argument("--shutdown-timeout", type=seconds, default=20.0, metavar="SECONDS",
                   help="on SIGTERM, let requests in flight finish for up to this long")
    p.add_argument("--read-timeout", type=seconds, default=60.0, metavar="SECONDS",
                   help="a request body must arrive within this long (else 408)")
    p.add_argument("--request-timeout", type=seconds, default=None, metavar="SECONDS",
                   help="end a generation that runs longer (408, or an error event in a stream)")
    p.add_argument("--grammar-compile-timeout", type=seconds, default=10.0, metavar="SECONDS",
                   help="an output constraint (JSON schema, regex, grammar) that takes longer to "
                        "compile is refused with a 400")
    p.add_argument("--grammar-compile-memory", type=mebibytes, default=MEMORY_BYTES >> 20,
                   metavar="MiB",
                   help="what compiling one output constraint may allocate in the server's "
                        "compiler process; a constraint that needs more is refused with a 400")
    p.add_argument("--debug", action="store_true", help="expose GET /debug/integrity")
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug", "trace"),
                   help="the server's log level (debug: a refused start's tracebacks too)")
    p.add_argument(
        "--pooling",
        choices=POOLINGS,
        default="last",
        help="how /v1/embeddings pools the final hidden states: the last token's, or the mean",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=[*REASONING_PARSERS, *REASONING_ALIASES],
        default=None,
        help="a reasoning model's thinking span (<think>...</think>) returned apart from its "
             "answer, as message.reasoning and reasoning_content",
    )
    p.add_argument(
        "--default-chat-template-kwargs",
        type=template_kwargs,
        default={},
        metavar="JSON",
        help="the chat template's variables for every request, e.g. "
             "'{\"enable_thinking\": false}' (a request's chat_template_kwargs win)",
    )
    p.add_argument("--batch-dir", default=None, metavar="PATH",
                   help="where the Batch API keeps its files and batches, private to this user "
                        "(a restarted server resumes the batches it finds there; one server a "
                        "folder, a second refused; default: $XDG_STATE_HOME/compiled-engine/"
                        "batches/port-PORT, else ~/.local/state/compiled-engine/batches/port-PORT)")
    p.add_argument("--max-batch-file-mb", type=mebibytes, default=200, metavar="MiB",
                   help="the largest file /v1/files takes, in MiB (2**20 bytes)")
    p.add_argument("--batch-disk-gb", type=gibibytes, default=10.0, metavar="GiB",
                   help="what the Batch API keeps, all files, batches and answers together, in "
                        "GiB (2**30 bytes; --kv-cache-disk-gb counts GB, 10**9): an upload or a "
                        "new batch past it is refused (413), a running batch stops there (its "
                        "lines left failed)")
    p.add_argument("--max-batch-output-mb", type=mebibytes, default=1024, metavar="MiB",
                   help="a batch's answers, output and error files together, in MiB (2**20 "
                        "bytes): past it, its lines left are error lines "
                        "(batch_output_too_large), unrun")
    p.add_argument(
        "--allow-runtime-lora-updating", action="store_true",
        help=f"let clients load and unload LoRA adapters while serving (/v1/load_lora_adapter, "
             f"/load_lora_adapter and their unloads; also ${RUNTIME_LORA_ENV}=1, as vLLM); "
             f"loads read only from --lora-dir",
    )
    p.add_argument("--lora-dir", type=folder, default=None, metavar="DIR",
                   help="the folder runtime adapter loads read from: a client's lora_path is "
                        "relative to it (or absolute inside it), symlinks out of it refused")
    p.add_argument(
        "--tool-call-parser",
        choices=PARSERS,
        default=None,
        help="the format of the model's tool calls (default: read from its chat template)",
    )


def server_config(args: argparse.Namespace, engine, api_keys: tuple[str, ...] = (),
                  torchrun=None) -> ServerConfig:
    """The server's settings from its flags (`add_serve_args`) and the engine's."""
    return ServerConfig(
        engine=engine,
        api_keys=api_keys,
        host=args.host,
        allowed_hosts=tuple(args.allowed_hosts or ()),
        send_timeout_s=args.send_timeout,
        shutdown_timeout_s=args.shutdown_timeout,
        read_timeout_s=args.read_timeout,
        request_timeout_s=args.request_timeout,
        grammar_compile_timeout_s=args.grammar_compile_timeout,
        grammar_compile_memory_bytes=args.grammar_compile_memory << 20,
        max_queue=args.max_queue,
        debug=args.debug,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        batch_dir=args.batch_dir or str(state_root() / f"port-{args.port}"),
        max_batch_file_bytes=args.max_batch_file_mb << 20,
        batch_disk_bytes=int(args.batch_disk_gb * (1 << 30)),
        max_batch_output_bytes=args.max_batch_output_mb << 20,
        default_chat_template_kwargs=args.default_chat_template_kwargs,
        pooling=args.pooling,
        allow_runtime_lora_updating=runtime_lora_updating(args),
        lora_dir=args.lora_dir,
        torchrun=torchrun,
    )
