"""One streaming `/v1/completions` request against any OpenAI-compatible server, timed per chunk (as
vLLM's `bench serve`: every SSE chunk with `choices` is a token arrival; `usage` gives the
count)."""

from __future__ import annotations

import json
import time

import httpx

from benchmarks.metrics import RequestTiming


def completion_body(model: str, prompt: list[int] | str, max_tokens: int) -> dict:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def stream_completion(
    client: httpx.AsyncClient, url: str, body: dict, prompt_len: int
) -> RequestTiming:
    """POST `body` to `url` and time the stream; failures are recorded, never raised."""
    timing = RequestTiming(prompt_len=prompt_len)
    chunks = 0
    usage_tokens: int | None = None
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                timing.error = (
                    f"HTTP {resp.status_code}: "
                    f"{(await resp.aread())[:200].decode(errors='replace')}"
                )
                return timing
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    timing.error = str(chunk["error"])[:200]
                    return timing
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if timing.ttft is None:
                        timing.ttft = now - start
                    else:
                        timing.itl.append(now - last)
                    last = now
                    chunks += 1
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        timing.error = f"{type(e).__name__}: {e}"
        return timing
    timing.output_len = usage_tokens if usage_tokens is not None else chunks
    timing.latency = last - start
    timing.success = timing.ttft is not None
    if not timing.success:
        timing.error = "no tokens streamed"
    return timing


async def fetch_metrics(client: httpx.AsyncClient, base_url: str) -> str | None:
    """The Prometheus text of `/metrics`, or None if the server has none."""
    try:
        resp = await client.get(base_url.rstrip("/") + "/metrics")
    except httpx.HTTPError:
        return None
    return resp.text if resp.status_code == 200 else None


def metric_value(text: str | None, suffix: str) -> float | None:
    """The value of the first sample whose metric name ends with `suffix` (labels ignored)."""
    for line in (text or "").splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name.endswith(suffix):
            return float(line.rsplit(" ", 1)[1])
    return None


async def first_model(client: httpx.AsyncClient, base_url: str) -> str:
    resp = await client.get(base_url.rstrip("/") + "/v1/models")
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]
