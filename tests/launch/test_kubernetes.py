"""The Kubernetes manifests (deploy/kubernetes/): valid, runnable as written, and in step with the services.

Contract, offline: every resource the kustomization lists validates against the Kubernetes JSON schemas in strict
mode (``kubernetes-validate`` bundles them; a deliberately broken copy fails); every Hindsight container's command
line and environment parse as that service's settings (``HINDSIGHT_POLICY_*`` / ``_JUDGE_*`` / ``_TRAIN_*`` name
fields of PolicySettings / JudgeSettings / TrainConfig, and nothing else starts with ``HINDSIGHT_``), torchrun's
and sglang-router's flags parse with their own parsers; every URL names a Service (or a StatefulSet pod) on a port
it serves, every Secret key, volume claim and Service selector resolves. With SGLang's venv
(tests/conformance/make_sglang_venv.sh), the engines' flags also parse with SGLang 0.5.23's own parser.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from engine.cli_settings import CliSettings, parse_settings
from judge_server.settings import JudgeSettings
from policy_server.settings import PolicySettings
from tests.conformance.test_sglang_conformance import sglang_python  # noqa: F401 - the venv fixture
from trainer.settings import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
# The oldest Kubernetes release the manifests target (Indexed Jobs' completion-index annotation: 1.28+).
K8S_VERSION = "1.31"
SERVICES: dict[str, tuple[type[CliSettings], str]] = {
    "hindsight-policy": (PolicySettings, "HINDSIGHT_POLICY_"),
    "hindsight-judge": (JudgeSettings, "HINDSIGHT_JUDGE_"),
    "trainer.cli": (TrainConfig, "HINDSIGHT_TRAIN_"),
}
# Variables other programs read (PostgreSQL's image) or that a command line expands ($(NAME)).
OTHER_ENV = {"POSTGRES_DB", "POSTGRES_USER", "POSTGRES_PASSWORD", "PGDATA", "ENGINE_API_KEY", "NODE_RANK"}
URL_RE = re.compile(r"https?://([a-z0-9.-]+):(\d+)")
SGLANG_LAUNCH = ["python", "-m", "sglang.launch_server"]


def load(directory: Path = KUBE) -> list[dict[str, Any]]:
    """Every resource of the kustomization in ``directory``, in its order."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    docs: list[dict[str, Any]] = []
    for name in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((directory / name).read_text()) if d is not None]
    return docs


RESOURCES = load()


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [d for d in RESOURCES if d["kind"] == kind]


def pod_specs() -> Iterator[tuple[str, dict[str, Any]]]:
    for d in RESOURCES:
        if d["kind"] in ("Deployment", "StatefulSet", "Job"):
            yield d["metadata"]["name"], d["spec"]["template"]["spec"]


def containers() -> Iterator[tuple[str, dict[str, Any]]]:
    for name, spec in pod_specs():
        for c in spec.get("initContainers", []) + spec["containers"]:
            yield f"{name}/{c['name']}", c


def expanded_argv(container: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """The container's command + args with ``$(VAR)`` expanded, and its environment as Kubernetes fills it in: a
    Secret key's value from the Secret manifest, a pod field a placeholder (a completion index: 0)."""
    secret = {k: v for s in by_kind("Secret") for k, v in s["stringData"].items()}
    env: dict[str, str] = {}
    for e in container.get("env", []):
        ref = e.get("valueFrom", {})
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "secretKeyRef" in ref:
            env[e["name"]] = secret[ref["secretKeyRef"]["key"]]
        else:
            env[e["name"]] = "0" if "job-completion-index" in str(ref) else "pod-name"
    argv = [*container.get("command", []), *container.get("args", [])]
    return [re.sub(r"\$\(([A-Z_]+)\)", lambda m: env[m.group(1)], a) for a in argv], env


def service_argv(argv: list[str]) -> tuple[str, list[str]] | None:
    """(service, its own flags) for a Hindsight command line, directly or under torchrun ``-m``; else None."""
    if argv[0] in SERVICES:
        return argv[0], argv[1:]
    if "-m" in argv and argv[argv.index("-m") + 1] in SERVICES:
        i = argv.index("-m")
        return argv[i + 1], argv[i + 2 :]
    return None


@pytest.mark.unit
def test_the_kustomization_lists_every_manifest():
    listed = set(yaml.safe_load((KUBE / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in KUBE.glob("*.yaml")} - {"kustomization.yaml"}


@pytest.mark.unit
@pytest.mark.parametrize("doc", RESOURCES, ids=[f"{d['kind']}/{d['metadata']['name']}" for d in RESOURCES])
def test_every_resource_validates_against_the_kubernetes_schema(doc):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _policy() -> dict[str, Any]:
    return copy.deepcopy(next(d for d in by_kind("Deployment") if d["metadata"]["name"] == "policy"))


def _break_replicas(d: dict[str, Any]) -> None:
    d["spec"]["replicas"] = "three"


def _break_probe(d: dict[str, Any]) -> None:
    d["spec"]["template"]["spec"]["containers"][0]["readinessProbe"] = {"httpGett": {"path": "/ready", "port": 30000}}


def _break_env(d: dict[str, Any]) -> None:
    d["spec"]["template"]["spec"]["containers"][0]["env"][0] = {"name": "X", "valueFrom": {"secretRef": {}}}


def _drop_selector(d: dict[str, Any]) -> None:
    del d["spec"]["selector"]


@pytest.mark.unit
@pytest.mark.parametrize("breakage", [_break_replicas, _break_probe, _break_env, _drop_selector])
def test_a_broken_manifest_fails_validation(breakage):
    doc = _policy()
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    breakage(doc)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.unit
def test_hindsight_commands_parse_as_the_services_settings(monkeypatch):
    seen = set()
    for where, c in containers():
        argv, env = expanded_argv(c)
        found = service_argv(argv)
        hindsight_env = {k for k in env if k.startswith("HINDSIGHT_")}
        if found is None:
            assert not hindsight_env, f"{where}: {hindsight_env} set for a program that is no Hindsight service"
            continue
        service, flags = found
        cls, prefix = SERVICES[service]
        unknown = {
            k for k in hindsight_env if not k.startswith(prefix) or k[len(prefix) :].lower() not in cls.model_fields
        }
        assert not unknown, f"{where}: {sorted(unknown)} are no {cls.__name__} fields (env prefix {prefix})"
        for k in list(os.environ):
            if k.startswith("HINDSIGHT_"):
                monkeypatch.delenv(k)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        settings = parse_settings(cls, flags, prog=service)
        seen.add(service)
        if isinstance(settings, PolicySettings):
            assert settings.store_url and settings.api_key and settings.admin_api_key
            assert len(settings.engine_worker_urls) == _replicas("policy-engine")
        if isinstance(settings, TrainConfig):
            assert settings.admin_api_key
        for k in env:
            monkeypatch.delenv(k)
    assert seen == set(SERVICES)


@pytest.mark.unit
def test_torchrun_and_router_flags_parse():
    from sglang_router.launch_router import parse_router_args
    from torch.distributed.run import get_args_parser

    for where, c in containers():
        argv, _ = expanded_argv(c)
        if argv[0] == "torchrun":
            i = argv.index("-m")
            args = get_args_parser().parse_args([*argv[1:i], "-m", argv[i + 1]])
            assert args.nnodes == str(by_kind("Job")[0]["spec"]["completions"]), where
            assert args.rdzv_endpoint.split(":")[0].startswith("trainer-0."), where
        if argv[:3] == ["python", "-m", "sglang_router.launch_router"]:
            args = parse_router_args(argv[3:])
            engine = where.split("/")[0].replace("-router", "-engine")
            assert len(args.worker_urls) == _replicas(engine), where


SGLANG_FLAGS = """
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser(exit_on_error=False)
ServerArgs.add_cli_args(parser)
for argv in json.loads(sys.argv[1]):
    try:
        args, unknown = parser.parse_known_args(argv)
        print(json.dumps({"unknown": unknown, "tp_size": args.tp_size, "port": args.port}))
    except (argparse.ArgumentError, SystemExit) as exc:
        print(json.dumps({"error": str(exc)}))
"""


@pytest.mark.e2e
def test_engine_flags_parse_as_sglangs(sglang_python):  # noqa: F811 - the venv fixture
    """The engines' flags by SGLang 0.5.23's own parser (its venv, tests/conformance/make_sglang_venv.sh); a
    misspelt flag is reported unknown."""
    engines = [expanded_argv(c)[0][3:] for _, c in containers() if expanded_argv(c)[0][:3] == SGLANG_LAUNCH]
    assert len(engines) == 2  # the policy's and the judge's StatefulSets
    argvs = [*engines, [*engines[0], "--mem-fraction-statik=0.8"]]
    res = subprocess.run(
        [str(sglang_python), "-c", SGLANG_FLAGS, json.dumps(argvs)], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    results = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert [r.get("unknown") for r in results[:2]] == [[], []], results
    assert results[2].get("unknown") == ["--mem-fraction-statik=0.8"], results[2]
    ports = {
        int(p["port"]) for d in by_kind("Service") if d["spec"].get("clusterIP") == "None" for p in d["spec"]["ports"]
    }
    assert {r["port"] for r in results[:2]} <= ports  # each engine listens where its headless Service says


def _replicas(statefulset: str) -> int:
    return int(next(d for d in by_kind("StatefulSet") if d["metadata"]["name"] == statefulset)["spec"]["replicas"])


@pytest.mark.unit
def test_references_resolve():
    services = {d["metadata"]["name"]: d for d in by_kind("Service")}
    ports = {name: {p["port"] for p in s["spec"]["ports"]} for name, s in services.items()}
    pods = {d["metadata"]["name"]: d for d in RESOURCES if d["kind"] in ("Deployment", "StatefulSet", "Job")}
    # a URL names a Service, or pod i of a StatefulSet (or Indexed Job) through its headless Service
    for where, c in containers():
        argv, _ = expanded_argv(c)
        for host, port in URL_RE.findall(" ".join(argv)):
            parts = host.split(".")
            if len(parts) == 2:
                owner, _, index = parts[0].rpartition("-")
                assert owner in pods and int(index) < int(pods[owner]["spec"].get("replicas", 0)), (where, host)
                assert parts[1] in services, (where, host)
            assert int(port) in ports[parts[-1]], (where, host, port)
    # every Service selects pods; every Secret key and volume claim exists
    labels = [d["spec"]["template"].get("metadata", {}).get("labels", {}) | {"job-name": n} for n, d in pods.items()]
    for name, s in services.items():
        sel = s["spec"]["selector"]
        assert any(sel.items() <= lab.items() for lab in labels), name
    keys = {k for s in by_kind("Secret") for k in s["stringData"]}
    claims = {d["metadata"]["name"] for d in by_kind("PersistentVolumeClaim")}
    for where, spec in pod_specs():
        for v in spec.get("volumes", []):
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims, where
        for c in spec["containers"]:
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                assert ref is None or ref["key"] in keys, (where, e["name"])
                assert e["name"].startswith("HINDSIGHT_") or e["name"] in OTHER_ENV, (where, e["name"])
