"""deploy/kubernetes: every manifest validates against the official Kubernetes schemas
(`kubernetes-validate`, offline), and the pieces fit together (labels, names, ports, the
server roles and the parameters the pods are started with)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

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
