"""The Kubernetes manifests of deploy/kubernetes (issue 31 §5): Kubernetes'
own schemas (kubernetes-validate, offline, strict: an unknown field fails),
the container's arguments read by `kvsched serve`'s own parser and the
router's by vllm-router's, and the contract between them: probes, the drain
and the grace period, the ports the arguments name, the pods the router and
the InferencePool address."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from serve_helpers import ROOT

yaml = pytest.importorskip("yaml")
DEPLOY = ROOT / "deploy" / "kubernetes"


def docs(name: str) -> dict[str, dict[str, Any]]:
    """A file's objects by kind."""
    return {d["kind"]: d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d}


def container(obj: dict[str, Any]) -> dict[str, Any]:
    (c,) = obj["spec"]["template"]["spec"]["containers"]
    return c


@pytest.mark.subprocess
def test_core_objects_validate_against_kubernetes_schemas():
    pytest.importorskip("kubernetes_validate")
    files = [str(DEPLOY / "kvsched.yaml"), str(DEPLOY / "vllm-router.yaml")]
    run = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", *files],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("passed") == 5, (
        run.stdout
    )  # secret, 2 services, statefulset, deployment


def test_a_broken_manifest_fails_the_validation(tmp_path: Path):
    """The check above can fail: a misspelt probe field is refused."""
    pytest.importorskip("kubernetes_validate")
    bad = (DEPLOY / "kvsched.yaml").read_text().replace("readinessProbe:", "readinesProbe:")
    (tmp_path / "bad.yaml").write_text(bad)
    run = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict",
                          str(tmp_path / "bad.yaml")], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert run.returncode != 0 and "readinesProbe" in run.stdout + run.stderr


def test_kvsched_pods_serve_drain_and_publish_as_their_arguments_say(tmp_path: Path):
    from kvsched.cli import build_parser
    from kvsched.cli.serve import _check_kv_events

    objs = docs("kvsched.yaml")
    sts, svc = objs["StatefulSet"], objs["Service"]
    c = container(sts)
    args = build_parser().parse_args(c["args"])
    _check_kv_events(args)  # what kvsched serve does before loading
    assert args.command == "serve" and args.host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["http"] == args.port
    assert args.kv_events == f"tcp://*:{ports['kv-events']}"
    assert args.kv_events_replay == f"tcp://*:{ports['kv-replay']}"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    pause = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace = sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= pause + args.drain_seconds + 10, "the drain must end before SIGKILL"
    mount = c["volumeMounts"][0]["mountPath"]
    assert args.tenants.startswith(mount + "/")
    # The tenants file in the Secret is one kvsched serve reads.
    pytest.importorskip("fastapi")
    from kvsched.serve.tenants import load_tenants

    toml = tmp_path / "tenants.toml"
    toml.write_text(objs["Secret"]["stringData"][Path(args.tenants).name])
    assert [e.name for e in load_tenants(toml)] == ["default"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["selector"].items() <= labels.items()
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]


def test_the_router_addresses_every_pod_and_its_events():
    from vllm_router.launch_router import parse_router_args

    from kvsched.cli import build_parser

    sts = docs("kvsched.yaml")["StatefulSet"]
    serve = container(sts)
    ports = {p["name"]: p["containerPort"] for p in serve["ports"]}
    name, svc, n = sts["metadata"]["name"], sts["spec"]["serviceName"], sts["spec"]["replicas"]
    pods = [f"{name}-{i}.{svc}" for i in range(n)]
    c = container(docs("vllm-router.yaml")["Deployment"])
    assert c["command"] == ["vllm-router"]
    r = parse_router_args(c["args"])
    assert r.policy == "kv_aware" and r.health_check_endpoint == "/ready"
    assert r.worker_urls == [f"http://{p}:{ports['http']}" for p in pods]
    assert r.kv_event_source == [f"http://{p}:{ports['http']}=tcp://{p}:{ports['kv-events']}"
                                 for p in pods]  # fmt: skip
    assert r.kv_event_replay_source == [
        f"http://{p}:{ports['http']}=tcp://{p}:{ports['kv-replay']}" for p in pods
    ]
    assert r.kv_event_block_size == build_parser().parse_args(serve["args"]).block_size


def test_the_inference_pool_selects_the_pods_on_their_port():
    objs = docs("inferencepool.yaml")
    pool, route = objs["InferencePool"], objs["HTTPRoute"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    assert set(spec) <= {"selector", "targetPorts", "appProtocol", "endpointPickerRef"}
    sts = docs("kvsched.yaml")["StatefulSet"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    http = next(p["containerPort"] for p in container(sts)["ports"] if p["name"] == "http")
    assert spec["targetPorts"] == [{"number": http}]
    ref = spec["endpointPickerRef"]
    assert ref["name"] and ref["port"]["number"] > 0
    assert ref["failureMode"] in ("FailOpen", "FailClose")
    (backend,) = route["spec"]["rules"][0]["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io", "InferencePool", pool["metadata"]["name"])  # fmt: skip
