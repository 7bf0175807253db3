"""deploy/'s Kubernetes manifests, offline: every object validates against the Kubernetes OpenAPI
schemas bundled in kubernetes-validate (strict: an unknown or misspelt field fails), and the pieces
fit together: the replicas' probes ask `/health` on the port they serve, the router discovers the
replica pods by their labels and port with flags its `launch_router --help` lists, its Role lets it
list and watch pods, and the Service selects the router's pods."""

from __future__ import annotations

import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from sglang_router.launch_router import parse_router_args

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
FILES = ("replica-deployment.yaml", "replica-network-policy.yaml", "router-deployment.yaml",
         "router-service.yaml")
# the oldest and newest schemas kubernetes-validate bundles
K8S_VERSIONS = ("1.25", "1.37")
REPLICA_PORT = 8000


def _load(name: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all((DEPLOY / name).read_text()) if doc]


def _one(name: str, kind: str) -> dict:
    (found,) = [doc for doc in _load(name) if doc["kind"] == kind]
    return found


def _container(deployment: dict) -> dict:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _pod_labels(deployment: dict) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


@cache
def _router_flags() -> frozenset[str]:
    """The options `python -m sglang_router.launch_router --help` lists (one per option line)."""
    out = subprocess.run(
        [sys.executable, "-m", "sglang_router.launch_router", "--help"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    return frozenset(re.findall(r"^\s+(--[a-z0-9][a-z0-9-]*)", out, re.MULTILINE))


def test_the_files_are_there() -> None:
    assert sorted(p.name for p in DEPLOY.glob("*.yaml")) == sorted(FILES)


def _schema_error(doc: dict, version: str) -> str | None:
    """Where `doc` breaks the (strict) schema of Kubernetes `version`, or None."""
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        where = ".".join(str(p) for p in e.path)
        return f"{doc['kind']}/{doc['metadata']['name']}: {where}: {e.message}"
    return None


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", FILES)
def test_schema_valid(name: str, version: str) -> None:
    docs = _load(name)
    assert docs
    errors = [err for doc in docs if (err := _schema_error(doc, version))]
    assert not errors, f"{name} against Kubernetes {version}: {errors}"


def test_replica_probes_and_cache() -> None:
    replica = _one("replica-deployment.yaml", "Deployment")
    container = _container(replica)
    command = container["command"]
    assert command[:2] == ["compiled-engine", "serve"]
    assert command[command.index("--port") + 1] == str(REPLICA_PORT)
    assert command[command.index("--host") + 1] == "0.0.0.0"
    assert any(p["containerPort"] == REPLICA_PORT for p in container["ports"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": REPLICA_PORT}, probe
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800  # cold torch.compile
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    cache_dir = env["COMPILED_ENGINE_CACHE"]
    assert any(cache_dir.startswith(m["mountPath"]) for m in container["volumeMounts"])
    assert container["resources"]["requests"]
    assert _pod_labels(replica).items() >= replica["spec"]["selector"]["matchLabels"].items()


def test_replicas_drain_take_their_key_from_a_secret_and_only_the_router_reaches_them() -> None:
    """SIGTERM's drain (--shutdown-timeout) plus preStop's sleep fit the grace period; the API key
    comes from a Secret (never argv, which `ps` shows); the NetworkPolicy lets only the router's
    pods reach the replicas' port."""
    replica = _one("replica-deployment.yaml", "Deployment")
    container = _container(replica)
    command = container["command"]
    assert "--api-key" not in command
    drain = float(command[command.index("--shutdown-timeout") + 1])
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    grace = replica["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert drain + float(pre_stop[1]) + 5 <= grace
    (key,) = [e for e in container["env"] if e["name"] == "COMPILED_ENGINE_API_KEY"]
    assert set(key["valueFrom"]["secretKeyRef"]) == {"name", "key"}
    policy = _one("replica-network-policy.yaml", "NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= _pod_labels(replica).items()
    (rule,) = policy["spec"]["ingress"]
    (source,) = rule["from"]
    router = _one("router-deployment.yaml", "Deployment")
    assert source["podSelector"]["matchLabels"].items() <= _pod_labels(router).items()
    assert rule["ports"] == [{"protocol": "TCP", "port": REPLICA_PORT}]
    services = [doc for name in FILES for doc in _load(name) if doc["kind"] == "Service"]
    assert [s["spec"]["selector"] for s in services] == [_pod_labels(router)]  # the one way in


def test_router_flags_exist_and_parse() -> None:
    args = _container(_one("router-deployment.yaml", "Deployment"))["args"]
    flags = {a for a in args if a.startswith("--")}
    assert flags <= _router_flags(), f"not in launch_router --help: {flags - _router_flags()}"
    parsed = parse_router_args(args)  # the router's own parser: choices and types
    assert parsed.service_discovery
    assert parsed.policy == "cache_aware"
    assert parsed.service_discovery_port == REPLICA_PORT
    assert parsed.host == "0.0.0.0"


def test_router_discovers_the_replicas() -> None:
    router = _one("router-deployment.yaml", "Deployment")
    parsed = parse_router_args(_container(router)["args"])
    replica_labels = _pod_labels(_one("replica-deployment.yaml", "Deployment"))
    assert parsed.selector and replica_labels.items() >= parsed.selector.items()
    assert not _pod_labels(router).items() >= parsed.selector.items()  # it must not find itself
    # namespaced discovery, so that a Role (not a ClusterRole) is enough
    namespace = parsed.service_discovery_namespace
    assert namespace == "$(POD_NAMESPACE)"
    (env,) = [e for e in _container(router)["env"] if e["name"] == "POD_NAMESPACE"]
    assert env["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"


def test_router_rbac() -> None:
    account = _one("router-deployment.yaml", "ServiceAccount")["metadata"]["name"]
    router = _one("router-deployment.yaml", "Deployment")
    assert router["spec"]["template"]["spec"]["serviceAccountName"] == account
    role = _one("router-deployment.yaml", "Role")
    pod_verbs = {
        verb
        for rule in role["rules"]
        if "" in rule["apiGroups"] and "pods" in rule["resources"]
        for verb in rule["verbs"]
    }
    assert {"get", "list", "watch"} <= pod_verbs
    binding = _one("router-deployment.yaml", "RoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["metadata"]["name"]
    }
    assert {"kind": "ServiceAccount", "name": account} in [
        {k: s[k] for k in ("kind", "name")} for s in binding["subjects"]
    ]


def test_service_selects_the_router() -> None:
    service = _one("router-service.yaml", "Service")
    router = _one("router-deployment.yaml", "Deployment")
    container = _container(router)
    assert _pod_labels(router).items() >= service["spec"]["selector"].items()
    replica_labels = _pod_labels(_one("replica-deployment.yaml", "Deployment"))
    assert not replica_labels.items() >= service["spec"]["selector"].items()
    router_port = parse_router_args(container["args"]).port
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    for port in service["spec"]["ports"]:
        target = port["targetPort"]
        assert named.get(target, target) == router_port
