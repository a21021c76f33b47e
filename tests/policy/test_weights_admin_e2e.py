"""The weight-version ledger over HTTP (policy_server.api.weights), against a real dev engine, on both stores.

Contract: GET /admin/weights lists the ledger (the engines' startup weights live); with --safe-updates a push
is canary, and the ledger answers the canary test's record (engine.sequential.Comparison), which the run report
reads; of two concurrent pushes one gets 409; a push while a canary runs gets 409; promote with no
canary gets 409; a rollback to an unknown version gets 404; a rollback drops the canary, the engine serves
the restored version again, and a push still descending from the rolled-back version, or naming no parent,
gets 409 until it names the restored one (the trainer's client reads that refusal as "reload the restored
version"); kill -9 of the policy server keeps the ledger.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.testkit.procs import start_dev_engine
from tests.testkit.servers import ADMIN_KEY, admin, start_policy
from trainer.lease_client import PolicyClient, WeightsRolledBack
from trainer.report import data as report_data
from trainer.report import page

pytestmark = pytest.mark.e2e


def _ledger(url: str) -> dict:
    with admin(url) as a:
        r = a.get("/admin/weights")
    assert r.status_code == 200, r.text
    return r.json()


def _states(url: str) -> dict[str, str]:
    return {v["version"]: v["state"] for v in _ledger(url)["versions"]}


def _engine_version(engine_url: str) -> str:
    return httpx.get(engine_url + "/model_info", trust_env=False).json()["weight_version"]


def test_ledger_routes(tiny_model_dir, store_url, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    engine = start_dev_engine(model, log_dir=tmp_path)
    extra = ["--store-url", store_url, "--safe-updates"]
    pol = start_policy(model, engine.url, tmp_path / "data", tmp_path, extra=extra)
    try:
        base = _ledger(pol.url)
        assert base["canary"] is None and base["live"] == _engine_version(engine.url)
        live0 = base["live"]
        assert base["versions"][0]["state"] == "live" and base["versions"][0]["checkpoint"] == str(model)
        with admin(pol.url) as a:
            assert a.post("/admin/weights/promote").status_code == 409  # no canary
            r = a.post("/admin/weights/rollback", json={"to": "never-pushed"})
            assert r.status_code == 404, r.text

            def push(version: str, parent: str | None = None) -> httpx.Response:
                body = {"model_path": str(model), "weight_version": version, "parent_version": parent}
                with admin(pol.url) as c:
                    return c.post("/admin/weights/update", json=body)

            with ThreadPoolExecutor(2) as pool:  # two concurrent pushes: one loads, the other is refused
                answers = list(pool.map(lambda v: push(v, live0), ["a", "b"]))
            assert sorted(r.status_code for r in answers) == [200, 409], [r.text for r in answers]
            won = next(r.json() for r in answers if r.status_code == 200)
            assert won["state"] == "canary"
            canary = won["weight_version"]
            assert _engine_version(engine.url) == canary
            no_sessions = {"sessions": 0, "mean": 0.0, "interval": {"lo": -1.0, "hi": 1.0}}
            assert _ledger(pol.url)["comparison"] == {
                "canary": no_sessions,
                "live": no_sessions,
                "diff": {"lo": -2.0, "hi": 2.0},
                "decision": "continue",
            }
            report = page.render(report_data.collect(tmp_path / "no-trainer", pol.url, ADMIN_KEY))
            assert "Canary now: canary - live in [-2.000, 2.000], decision continue." in report
            r = push("c", canary)
            assert r.status_code == 409 and r.json()["error"]["code"] == "canary_in_progress"

            r = a.post("/admin/weights/rollback", json={})  # drop the canary
            assert r.status_code == 200, r.text
            assert r.json()["live"]["version"] == live0
            assert [v["version"] for v in r.json()["rolled_back"]] == [canary]
            assert _engine_version(engine.url) == live0
            r = push("d", canary)  # trained on the rolled-back weights: refused until it reloads
            assert r.status_code == 409 and r.json()["error"]["code"] == "weights_rolled_back"
            r = push("d")  # no lineage: the server cannot tell where these weights come from
            assert r.status_code == 409 and r.json()["error"]["code"] == "parent_required", r.text
            assert f"parent_version {live0}" in r.json()["error"]["message"]
            assert next(v for v in _ledger(pol.url)["versions"] if v["version"] == live0)["parent_required"]
            trainer = PolicyClient(pol.url, ADMIN_KEY)
            with pytest.raises(WeightsRolledBack) as refused:  # what the trainer does with it: reload live0
                trainer.update_weights(str(model), "d")
            trainer.close()
            assert refused.value.live.version == live0
            r = push("d", live0)
            assert r.status_code == 200 and r.json()["state"] == "canary", r.text
            assert not next(v for v in _ledger(pol.url)["versions"] if v["version"] == live0)["parent_required"]
            r = a.post("/admin/weights/promote")
            assert r.status_code == 200 and r.json()["version"]["state"] == "live"
            r = a.post("/admin/weights/rollback", json={"to": canary})
            assert r.status_code == 409 and r.json()["error"]["code"] == "not_restorable"
        before = _states(pol.url)
        assert before == {"d": "live", canary: "rolled_back", live0: "retired"}
        pol.kill()  # kill -9: the ledger is in the store
        pol = start_policy(model, engine.url, tmp_path / "data", tmp_path, name="policy-2", extra=extra)
        assert _states(pol.url) == before
    finally:
        pol.stop()
        engine.stop()
