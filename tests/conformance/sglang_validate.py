"""Validate recorded engine request bodies with SGLang 0.5.23's own request classes.

Runs INSIDE the separate SGLang venv (tests/conformance/make_sglang_venv.sh), never in the project venv, so
it imports nothing of the project. Input on stdin: ``{"vocab_size": int, "stop_token_ids": {str: [int]},
"records": [{"method", "path", "body"}]}`` (records as devkit.dev_server.recording writes them; the stop
table is the tokenizer's ``encode(s, add_special_tokens=False)`` of each stop string, computed by the test
with the real tokenizer because this venv has none of the tiny model's). Output on stdout: one JSON list,
``[{"index", "path", "ok", "error"}]``, one entry per record.

What each path goes through, as in SGLang's HTTP server and tokenizer manager:
- ``/generate``: ``generate_contract_error(body)`` (the server's JSON contract check), then
  ``GenerateReqInput(**body).normalize_batch_and_arguments()``, then for each request's sampling params
  ``SamplingParams(**sp)``, ``.normalize(tokenizer)`` and ``.verify(vocab_size)``.
- control endpoints: ``pydantic.TypeAdapter(<its io_struct class>).validate_python(body)``, the schema
  FastAPI decodes those msgspec structs with (``BaseReq.__get_pydantic_core_schema__``); a key the class
  does not have is an error here although SGLang ignores it silently: an ignored key is an intent the
  engine drops.
- ``/flush_cache`` takes no body; any other path is an error ("no validator"), so a new endpoint the
  services start calling cannot pass unchecked.
"""

from __future__ import annotations

import json
import sys
import traceback
import warnings
from typing import Any

warnings.filterwarnings("ignore")  # sglang warns on import that CPU lacks its GPU kernels

from pydantic import TypeAdapter  # noqa: E402
from sglang.srt.entrypoints.api_contract import generate_contract_error  # noqa: E402
from sglang.srt.managers import io_struct  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

CONTROL_CLASSES = {
    "/pause_generation": io_struct.PauseGenerationReqInput,
    "/continue_generation": io_struct.ContinueGenerationReqInput,
    "/update_weights_from_disk": io_struct.UpdateWeightFromDiskReqInput,
    "/update_weight_version": io_struct.UpdateWeightVersionReqInput,
    "/abort_request": io_struct.AbortReq,
}


class TableTokenizer:
    """The one tokenizer method SamplingParams.normalize uses, answered from the test's table."""

    def __init__(self, table: dict[str, list[int]]) -> None:
        self.table = table

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if text not in self.table:
            raise KeyError(f"stop string {text!r} missing from the test's tokenizer table")
        return list(self.table[text])


def validate_generate(body: Any, tokenizer: TableTokenizer, vocab_size: int) -> None:
    error = generate_contract_error(body)
    if error is not None:
        raise ValueError(f"contract: {error}")
    obj = io_struct.GenerateReqInput(**body)
    obj.normalize_batch_and_arguments()
    params = obj.sampling_params if isinstance(obj.sampling_params, list) else [obj.sampling_params]
    for sp in params:
        sampling = SamplingParams(**dict(sp or {}))
        sampling.normalize(tokenizer)
        sampling.verify(vocab_size)


def validate_control(path: str, body: Any) -> None:
    cls = CONTROL_CLASSES[path]
    if not isinstance(body, dict):
        raise ValueError(f"{path} needs a JSON object body (at least {{}}), got {body!r}")
    unknown = sorted(set(body) - set(cls.__struct_fields__))
    if unknown:
        raise ValueError(f"{path}: {cls.__name__} has no field(s) {unknown} (SGLang would ignore them)")
    TypeAdapter(cls).validate_python(body)


def validate(record: dict[str, Any], tokenizer: TableTokenizer, vocab_size: int) -> None:
    path, body = record["path"], record["body"]
    if path == "/generate":
        validate_generate(body, tokenizer, vocab_size)
    elif path in CONTROL_CLASSES:
        validate_control(path, body)
    elif path == "/flush_cache":
        return
    else:
        raise ValueError(f"no validator for {record['method']} {path}")


def main() -> None:
    task = json.load(sys.stdin)
    tokenizer = TableTokenizer(task["stop_token_ids"])
    out = []
    for i, record in enumerate(task["records"]):
        try:
            validate(record, tokenizer, int(task["vocab_size"]))
            out.append({"index": i, "path": record["path"], "ok": True, "error": None})
        except Exception as exc:  # every failure is reported per record, never raised
            out.append(
                {
                    "index": i,
                    "path": record["path"],
                    "ok": False,
                    "error": f"{type(exc).__name__}: {exc}",
                    "where": traceback.format_exc(limit=-2),
                }
            )
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
