"""An instant, protocol-faithful engine stub for benchmarks ONLY (never used by the services or tests).

Answers SGLang's native ``/generate`` at once with a canned reply: the given ``--output-ids`` and ``--text``,
``meta_info`` with the keys real SGLang sends (id, finish_reason stop on the last id, prompt_tokens,
completion_tokens, cached_tokens, weight_version, e2e_latency, and ``output_token_logprobs`` when asked),
a list of n items for ``sampling_params.n > 1``, and the cumulative chunks + ``data: [DONE]`` when streaming.
Also ``/health``, ``/model_info``, ``/get_model_info``, ``/get_weight_version``, ``/abort_request``,
``/flush_cache``, ``/pause_generation``, ``/continue_generation``, ``/update_weights_from_disk`` (instant).
With it a benchmark measures what a proxy adds, not the engine's own queueing.

    python -m bench.instant_engine --port N --output-ids 17,18,151645 --text "ok" [--update-pause-s 0.5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse


def create_app(output_ids: list[int], text: str, update_pause_s: float = 0.0) -> FastAPI:
    app = FastAPI()
    state = {"weight_version": "default"}

    def item(body: dict[str, Any], started: float) -> dict[str, Any]:
        prompt = body.get("input_ids") or []
        meta: dict[str, Any] = {
            "id": uuid.uuid4().hex,
            "finish_reason": {"type": "stop", "matched": output_ids[-1]},
            "prompt_tokens": len(prompt),
            "completion_tokens": len(output_ids),
            "cached_tokens": 0,
            "reasoning_tokens": 0,
            "weight_version": state["weight_version"],
            "num_retractions": 0,
            "e2e_latency": time.monotonic() - started,
        }
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[-0.5, t, None] for t in output_ids]
            meta["output_token_logprobs_length"] = len(output_ids)
            meta["input_token_logprobs"] = [[None, prompt[-1], None]] if prompt else []
        return {"text": text, "output_ids": list(output_ids), "meta_info": meta}

    @app.get("/health")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("")

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {
            "model_path": "instant-stub",
            "tokenizer_path": None,
            "is_generation": True,
            "weight_version": state["weight_version"],
        }

    @app.get("/get_weight_version")
    async def weight_version() -> dict[str, Any]:
        return {"weight_version": state["weight_version"]}

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        started = time.monotonic()
        body = await request.json()
        n = int((body.get("sampling_params") or {}).get("n", 1))
        items = [item(body, started) for _ in range(n)]
        if body.get("stream"):

            async def events():
                for i, it in enumerate(items):
                    yield f"data: {json.dumps({**it, 'index': i})}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        return JSONResponse(items if n > 1 else items[0])

    @app.post("/update_weights_from_disk")
    async def update(request: Request) -> dict[str, Any]:
        body = await request.json()
        await asyncio.sleep(update_pause_s)  # what a real engine spends loading weights
        state["weight_version"] = str(body.get("weight_version") or state["weight_version"])
        return {"success": True, "message": "ok", "num_paused_requests": 0}

    for path in ("/abort_request", "/flush_cache", "/pause_generation", "/continue_generation"):
        app.add_api_route(path, lambda: {"success": True}, methods=["GET", "POST"])
    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--output-ids", required=True, help="comma-separated token ids of the canned reply")
    p.add_argument("--text", default="ok")
    p.add_argument("--update-pause-s", type=float, default=0.0)
    a = p.parse_args()
    app = create_app([int(x) for x in a.output_ids.split(",")], a.text, a.update_pause_s)
    uvicorn.run(app, host="127.0.0.1", port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
