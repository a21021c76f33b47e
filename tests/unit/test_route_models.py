"""Routes return their response models, so each body is written once.

Read from the source with ``ast`` (nothing is imported) over every router module of the two services: each
route declares its 200 body as a pydantic model (``response_model=M``, or FastAPI's inference from the return
annotation) and its handler is annotated to return that model, ``M`` (or ``M | Response``: a bare status
answer when the client went away). The model the OpenAPI documents is then the one the route builds; no body is
a dict kept in step with a model by hand.

``PLAIN`` lists the routes whose answer is no JSON model, each with why: the list must match the source exactly.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
ROUTERS = [*sorted((ROOT / "policy_server" / "api").rglob("*.py")), ROOT / "judge_server" / "routes.py"]
VERBS = {"get", "post", "put", "patch", "delete"}
NOT_A_MODEL = {"Response", "JSONResponse", "StreamingResponse", "PlainTextResponse", "dict", "Any", "None"}

PLAIN = {
    # An event stream, or the chat-shaped JSON written on the hot path (checked against its models by
    # tests/reliability/test_schemathesis.py).
    "policy_server/api/chat/routes.py:chat_completions": "event stream or the hot-path completion",
    "policy_server/api/responses/routes.py:create_response": "event stream or the hot-path completion",
    "policy_server/api/messages/routes.py:create_message": "event stream or the hot-path completion",
    # Prometheus text.
    "policy_server/api/ops.py:metrics": "Prometheus text",
    "judge_server/routes.py:metrics": "Prometheus text",
}


def _route_verb(fn: ast.AsyncFunctionDef | ast.FunctionDef) -> ast.Call | None:
    for dec in fn.decorator_list:
        if (
            isinstance(dec, ast.Call)
            and isinstance(dec.func, ast.Attribute)
            and dec.func.attr in VERBS
            and isinstance(dec.func.value, ast.Name)
            and dec.func.value.id == "router"
        ):
            return dec
    return None


def route_problems(source: str, where: str) -> tuple[dict[str, str], set[str]]:
    """(``where:handler -> what is wrong`` for each route that does not return its model, the plain routes)."""
    problems: dict[str, str] = {}
    plain: set[str] = set()
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.AsyncFunctionDef | ast.FunctionDef):
            continue
        dec = _route_verb(fn)
        if dec is None:
            continue
        name = f"{where}:{fn.name}"
        declared = next((k.value for k in dec.keywords if k.arg == "response_model"), None)
        returns = fn.returns
        if isinstance(returns, ast.Constant) and isinstance(returns.value, str):
            returns = ast.parse(returns.value, mode="eval").body
        if returns is None:
            problems[name] = "no return annotation"
            continue
        # ``M | Response``: the model, or a bare status answer (the client went away)
        if isinstance(returns, ast.BinOp) and ast.unparse(returns.right) == "Response":
            returns = returns.left
        answer = ast.unparse(returns)
        if answer in NOT_A_MODEL or (declared is not None and ast.unparse(declared) == "None"):
            plain.add(name)
            continue
        if declared is not None and ast.unparse(declared) != answer:
            problems[name] = f"response_model={ast.unparse(declared)} but returns {answer}"
    return problems, plain


def test_the_check_sees_each_way_a_route_can_miss_its_model() -> None:
    source = (
        "@router.get('/a', response_model=A)\nasync def a() -> A: ...\n"
        "@router.get('/b', response_model=B)\nasync def b() -> B | Response: ...\n"
        "@router.get('/c')\nasync def c() -> C: ...\n"
        "@router.get('/d', response_model=None)\nasync def d() -> dict[str, Any]: ...\n"
        "@router.get('/e', response_model=E)\nasync def e() -> dict[str, Any]: ...\n"
        "@router.get('/f', response_model=F)\nasync def f(): ...\n"
        "@router.get('/g')\nasync def g() -> Response: ...\n"
        "def helper() -> dict: ...\n"
    )
    problems, plain = route_problems(source, "x.py")
    assert problems == {"x.py:e": "response_model=E but returns dict[str, Any]", "x.py:f": "no return annotation"}
    assert plain == {"x.py:d", "x.py:g"}


def test_every_route_returns_its_response_model() -> None:
    problems: dict[str, str] = {}
    plain: set[str] = set()
    for path in ROUTERS:
        found, bare = route_problems(path.read_text(encoding="utf-8"), path.relative_to(ROOT).as_posix())
        problems.update(found)
        plain |= bare
    assert problems == {}
    assert sorted(plain) == sorted(PLAIN)
