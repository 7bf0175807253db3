"""The suite's shared servers (tests/helpers/servers.py starts them)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.helpers.servers import RunningServer, start_server


@pytest.fixture(scope="session")
def server() -> Iterator[RunningServer]:
    """The default configuration (debug endpoint on, room for 64 concurrent streams)."""
    running = start_server(debug=True, max_queue=256)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return server.openai()


@pytest.fixture(scope="session")
def hf_demo():
    """transformers' fp32 model of the demo checkpoint (the oracle of the served demo model)."""
    import torch
    from transformers import AutoModelForCausalLM

    from compiled_engine.models.demo import demo_model_dir

    return AutoModelForCausalLM.from_pretrained(str(demo_model_dir()), dtype=torch.float32)


@pytest.fixture(scope="session")
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with server.http() as client:
        yield client


