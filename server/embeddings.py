"""`POST /v1/embeddings` (OpenAI's shape) from the served generative model: each input is a
prefill-only request through the same scheduler (max_tokens 0: its pages go back as its prefill
ends) whose final hidden states are pooled as `--pooling` says (the last token's, or the mean) and
L2-normalized by the engine."""

from __future__ import annotations

import array
import base64
import sys

from starlette.requests import Request
from starlette.responses import Response

from compiled_engine.sampling_params import SamplingParams
from server.handlers import (
    collect,
    endpoint,
    json_response,
    model_name,
    new_generation,
    read_json,
    state_of,
    tokenize_prompts,
)
from server.protocol import (
    GenerationRequest,
    ProtocolError,
    check_fields,
    get_int,
    get_str,
    prompts_field,
    require_object,
)

FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user", "priority"})
ENCODINGS = ("float", "base64")


def _encoded(vector: list[float], encoding: str) -> list[float] | str:
    """base64: the float32 values' little-endian bytes, as OpenAI sends them."""
    if encoding == "float":
        return vector
    values = array.array("f", vector)
    if sys.byteorder != "little":
        values.byteswap()
    return base64.b64encode(values.tobytes()).decode()


@endpoint("embeddings")
async def embeddings(request: Request) -> Response:
    st = state_of(request)
    body = require_object(await read_json(request))
    check_fields(body, FIELDS)
    get_str(body, "user", None)
    encoding = get_str(body, "encoding_format", "float")
    if encoding not in ENCODINGS:
        raise ProtocolError(
            f"'encoding_format' must be one of {', '.join(ENCODINGS)}, got {encoding!r}",
            "encoding_format",
        )
    size = st.client.handle.ready.hidden_size
    dimensions = get_int(body, "dimensions", None, 1, 2**31)
    if dimensions is not None and dimensions != size:
        raise ProtocolError(
            f"'dimensions' is {dimensions}, but this model's embeddings have {size} dimensions "
            "and cannot be shortened (it was not trained for that)",
            "dimensions",
        )
    prompts = await tokenize_prompts(st, prompts_field(body, st.limits, "input"))
    for i, ids in enumerate(prompts):
        if len(ids) >= st.limits.max_context:
            raise ProtocolError(f"input {i} has {len(ids)} tokens but the context limit is "
                                f"{st.limits.max_context}; shorten it", "input")
    params = SamplingParams(max_tokens=0, pooling=st.config.pooling,
                            priority=get_int(body, "priority", 0, -(2**31), 2**31 - 1))
    req = GenerationRequest(params, 0, "max_tokens", model=get_str(body, "model", None))
    gen = new_generation(st, "embd", req, prompts, 0)
    await collect(request, st, gen)
    for c in gen.choices:
        if c.embedding is None:
            raise ProtocolError(f"input {c.index} got no embedding: {c.error or c.finish_reason}",
                                status=500, kind="server_error")
    data = [
        {"object": "embedding", "index": c.index, "embedding": _encoded(c.embedding, encoding)}
        for c in gen.choices
    ]
    tokens = gen.prompt_tokens
    return json_response({
        "object": "list",
        "data": data,
        "model": model_name(st, req),
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    })
