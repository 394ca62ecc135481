"""deploy/kubernetes: every manifest validates against the official Kubernetes schemas
(`kubernetes-validate`, offline), and the pieces fit together (labels, names, ports, the
server roles and the parameters the pods are started with); the Secrets ship no value that
works, the front gets its API key, and the NetworkPolicy keeps the KV ports to the pools."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from backends.stages.keys import weakness
from backends.stages.params import parse_params

kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (.[dev])")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
K8S_VERSION = "1.30.0"


def docs() -> list[dict]:
    out = []
    for f in sorted(DEPLOY.glob("*.yaml")):
        out += [d for d in yaml.safe_load_all(f.read_text()) if d]
    return out


def by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs() if d["kind"] == kind}


@pytest.mark.parametrize("doc", docs(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_manifest_validates_against_the_kubernetes_schema(doc):
    kv.validate(doc, K8S_VERSION, strict=True)  # raises ValidationError on any schema error


def test_the_schema_check_catches_a_broken_manifest():
    bad = dict(by_kind("Deployment")["pd-prefill"])
    bad["spec"] = {**bad["spec"], "replicas": "two"}
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S_VERSION, strict=True)


def test_pools_services_and_configuration_fit_together():
    deps, svcs = by_kind("Deployment"), by_kind("Service")
    maps, secrets = by_kind("ConfigMap"), by_kind("Secret")
    assert set(deps) == {"pd-prefill", "pd-decode"} and set(svcs) == {"pd-prefill", "pd-decode"}
    assert svcs["pd-prefill"]["spec"]["clusterIP"] == "None"  # one DNS address per pod
    for name, dep in deps.items():
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert svcs[name]["spec"]["selector"].items() <= labels.items()
        pod = dep["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        role = name.removeprefix("pd-")
        assert c["args"][c["args"].index("--role") + 1] == role
        ports = {p["name"] for p in c["ports"]}
        assert {p["targetPort"] for p in svcs[name]["spec"]["ports"]} <= ports
        if role == "decode":  # the OpenAI front: serve.sh's default port, in the Service too
            assert {"name": "openai", "containerPort": 9000} in c["ports"]
            assert "--no-openai" not in c["args"] and "openai" in ports
        vols = {v["name"]: v for v in pod["volumes"]}
        assert vols["secret"]["secret"]["secretName"] in secrets
        params = maps[vols["params"]["configMap"]["name"]]["data"]["params"]
        sets = [ln.split("#")[0].strip() for ln in params.splitlines()]
        for item in filter(None, sets):  # every parameter is known and valid
            key, _, value = item.partition("=")
            stage, _, pname = key.rpartition(".")
            parse_params({pname: value}, stage or None)
        # readiness that tells the truth: Triton's ready AND pd_ready (scripts/health.py), on
        # the address the server listens on
        probe = " ".join(c["readinessProbe"]["exec"]["command"])
        assert "/opt/pd-triton/scripts/health.py" in probe and '--host "$POD_IP"' in probe
        assert (DEPLOY.parents[1] / "scripts" / "health.py").is_file()
        assert "POD_IP" in {e["name"] for e in c["env"]}
        assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    decode_params = maps["pd-decode-params"]["data"]["params"]
    assert "prefill_servers=pd-prefill:8001:8002" in decode_params


def _matches(selector: dict, labels: dict) -> bool:
    """A label selector (matchLabels, matchExpressions with In) against a pod's labels."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for e in selector.get("matchExpressions", []):
        assert e["operator"] == "In", e
        if labels.get(e["key"]) not in e["values"]:
            return False
    return True


def test_the_secrets_cannot_work_as_shipped_and_the_front_needs_its_key():
    secrets = by_kind("Secret")
    assert set(secrets) == {"pd-shared-secret", "pd-api-key"}
    for name, s in secrets.items():  # placeholders every server refuses (keys.py)
        for key, value in s["stringData"].items():
            assert weakness(value) is not None, (name, key)
    readme = (DEPLOY / "README.md").read_text() + (DEPLOY / "secret.yaml").read_text()
    for name, key in (("pd-shared-secret", "secret"), ("pd-api-key", "keys")):
        cmd = f'kubectl create secret generic {name} --from-literal={key}="$(openssl rand -hex 32)"'
        assert cmd in readme
    (c,) = by_kind("Deployment")["pd-decode"]["spec"]["template"]["spec"]["containers"]
    path = c["args"][c["args"].index("--api-key-file") + 1]
    pod = by_kind("Deployment")["pd-decode"]["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in pod["volumes"]}
    mount = next(m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    assert vols[mount["name"]]["secret"]["secretName"] == "pd-api-key"
    assert path.rsplit("/", 1)[1] in secrets["pd-api-key"]["stringData"]


def test_network_policy_admits_the_kv_ports_only_from_the_deployments_pods():
    deps, policies = by_kind("Deployment"), by_kind("NetworkPolicy")
    pools = [d["spec"]["template"]["metadata"]["labels"] for d in deps.values()]
    outsider = {"app.kubernetes.io/name": "something-else"}
    for name, dep in deps.items():
        labels = dep["spec"]["template"]["metadata"]["labels"]
        mine = [p for p in policies.values() if _matches(p["spec"]["podSelector"], labels)]
        assert len(mine) == 1, name
        (policy,) = mine
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        open_ports = set()
        for rule in policy["spec"]["ingress"]:
            if "ports" not in rule:  # every port (control, Mooncake): the pools' pods only
                peers = rule["from"]
                assert all(set(p) == {"podSelector"} for p in peers), peers
                assert all(any(_matches(p["podSelector"], pool) for p in peers) for pool in pools)
                assert not any(_matches(p["podSelector"], outsider) for p in peers)
            else:
                open_ports |= {p["port"] for p in rule["ports"]}
        (c,) = dep["spec"]["template"]["spec"]["containers"]
        assert open_ports <= {p["containerPort"] for p in c["ports"]} and 8002 in open_ports
        if name == "pd-decode":
            assert {9000, 8000, 8001} <= open_ports
        else:
            assert open_ports == {8002}  # a prefill pod's Triton ports: the pools only
