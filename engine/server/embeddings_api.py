"""/v1/embeddings: OpenAI's request and response over the engine's pooling (core/pooling.py).

Each input (a string, or a list of token ids) is one engine request with PoolingParams: it is prefilled with the
generation traffic under the same per-step token budget, pooled, and its blocks are freed when it finishes.
`encoding_format: base64` sends each vector as the base64 of its little-endian float32 bytes, as OpenAI does (the
`openai` client asks for it by default and decodes it). A client that disconnects aborts its inputs at once.
"""

from __future__ import annotations

import array
import base64
import sys
import time
import uuid

from aiohttp import web

from shoal.engine.contracts import PoolingParams
from shoal.engine.server.common import (
    check_model,
    get_state,
    json_response,
    read_json,
    require_loaded,
)
from shoal.engine.server.openai_api import Job, end_jobs, start_jobs
from shoal.engine.server.protocol import APIError, EmbeddingRequest


def _encode(vector, encoding_format: str):
    values = vector.tolist()
    if encoding_format == "base64":
        packed = array.array("f", values)  # float32
        if sys.byteorder == "big":
            packed.byteswap()
        return base64.b64encode(packed.tobytes()).decode("ascii")
    return values


async def create_embedding(request: web.Request) -> web.Response:
    state = get_state(request)
    req: EmbeddingRequest = await read_json(request, EmbeddingRequest)
    if check_model(state, req.model) is not None:
        raise APIError("embeddings under a LoRA adapter are not supported; use the base model", 400, param="model")
    require_loaded(state)
    try:
        inputs = req.inputs()
        params = PoolingParams(dimensions=req.dimensions)
    except ValueError as e:
        raise APIError(str(e), 400, param="dimensions" if str(e).startswith("dimensions") else "input") from None
    tok = state.engine.tokenizer
    jobs = [Job(list(tok.encode(x, add_special_tokens=req.add_special_tokens)), x) if isinstance(x, str)
            else Job(list(x), "") for x in inputs]
    base_id = f"embd-{uuid.uuid4().hex}"
    created = int(time.time())
    state.active_handlers += 1
    try:
        await start_jobs(state, base_id, jobs, params, req.priority, "input")
        try:
            data = []
            for i, job in enumerate(jobs):
                vector = None
                async for out in job.stream:
                    job.metrics = out.metrics or job.metrics
                    vector = out.embedding if out.finished else vector
                if vector is None:  # the engine stopped it (shutdown, failure) before it finished
                    raise APIError("the embedding request was aborted before it finished", 503, code="aborted")
                data.append({"object": "embedding", "index": i, "embedding": _encode(vector, req.encoding_format)})
        finally:
            end_jobs(request, state, jobs, "embeddings", state.served_model_name)
    finally:
        state.active_handlers -= 1
    tokens = sum(len(j.prompt_ids) for j in jobs)
    return json_response({"id": base_id, "object": "list", "created": created, "model": state.served_model_name,
                          "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}},
                         headers={"X-Request-Id": base_id})
