"""deploy/helm/gpusched: every value a template names exists in values.yaml, the template blocks
balance, files/ links to the deploy files it ships, `helm lint --strict` passes, and `helm
template` (Helm's Go SDK, through helm-python-sdk) renders objects that pass
`kubernetes-validate --strict` (defaults; cert-manager, the Prometheus Operator's API and an Ingress)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from .test_deploy_files import assert_one_policy, containers

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "gpusched"
KUBE_VERSION = "1.37"
CRD_KINDS = {"ServiceMonitor", "PrometheusRule", "Certificate", "Issuer"}  # not in kubernetes-validate's schemas
try:  # Helm's own Go SDK as a library (the helm-python-sdk test extra): `helm template` and `helm lint`
    import helm_python
    from helm_python import _native
except ImportError:  # pragma: no cover - the test extra is missing
    helm_python = None
needs_helm = pytest.mark.skipif(helm_python is None, reason="helm-python-sdk is not installed (pip install "
                                "'.[test]'): the chart is checked statically only, not rendered")


def _templates() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted((CHART / "templates").iterdir()) if p.suffix in (".yaml", ".tpl")}


def _has(values: object, path: list[str]) -> bool:
    for key in path:
        if isinstance(values, list):
            return True  # an item's fields: checked where the range uses them
        if not isinstance(values, dict) or key not in values:
            return False
        values = values[key]
    return True


def test_every_value_a_template_names_exists():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    named = {m for text in _templates().values() for m in re.findall(r"\.Values\.([A-Za-z0-9_.]+)", text)}
    assert len(named) > 20
    assert sorted(n for n in named if not _has(values, n.split("."))) == []


def test_template_blocks_balance():
    for name, text in _templates().items():
        actions = re.findall(r"\{\{-?\s*(if|range|with|define|end)\b", text)
        depth = 0
        for action in actions:
            depth += -1 if action == "end" else 1
            assert depth >= 0, f"{name}: an end without its block"
        assert depth == 0, f"{name}: {depth} blocks not closed"
        assert "{{" not in re.sub(r"\{\{.*?\}\}", "", text, flags=re.S), f"{name}: an action not closed"


def test_the_chart_ships_the_deploy_files():
    for name, target in {"alerts.yml": "prometheus/alerts.yml", "gpusched.json": "grafana/gpusched.json",
                         "nats-cluster.conf": "k8s/nats-cluster.conf"}.items():
        link = CHART / "files" / name
        assert link.is_symlink() and link.resolve() == (ROOT / "deploy" / target).resolve(), name
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = (ROOT / "pyproject.toml").read_text()
    assert f'version = "{chart["appVersion"]}"' in project  # the image tag is the release


def _render(values: dict | None = None, api_versions: tuple[str, ...] = ()) -> list[dict]:
    """`helm template gpusched CHART -n gpusched --kube-version K [--api-versions ...]`, parsed."""
    import json

    chart = helm_python.Chart.load(CHART)
    opts = {"name": "gpusched", "namespace": "gpusched", "kube_version": f"v{KUBE_VERSION}.0",
            "is_install": True, "api_versions": list(api_versions)}
    # Chart.render has no api_versions argument; the library's render call takes it (unknown keys are refused).
    manifests = json.loads(_native.call_string("helm_render", chart._raw(), json.dumps(values or {}),
                                               json.dumps(opts)))
    return [d for path, text in manifests.items() if path.endswith(".yaml")
            for d in yaml.safe_load_all(text) if isinstance(d, dict)]


def _validate(docs: list[dict]) -> None:
    import kubernetes_validate

    for doc in docs:
        if doc["kind"] not in CRD_KINDS:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


@needs_helm
def test_helm_lint_strict():
    helm_python.lint(CHART, strict=True, kube_version=f"v{KUBE_VERSION}.0")  # raises on any finding


@needs_helm
def test_default_render_validates_and_forms_a_cluster():
    docs = _render()
    _validate(docs)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("StatefulSet", "nats") in kinds and ("Job", "gpusched-bootstrap") in kinds
    assert [d for d in docs if d["kind"] == "DaemonSet"] and len([d for d in docs if d["kind"] == "DaemonSet"]) == 1
    assert not {k for k, _ in kinds} & {"ServiceMonitor", "PrometheusRule"}  # no operator CRDs: none
    dash = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "dashboard")
    env = {e["name"]: e for e in dash["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "dashboard.gpusched.svc" in env["GPUSCHED_DASHBOARD_HOSTS"]["value"].split(",")
    api = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "api")
    pod = api["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["GPUSCHED_KEYS"] == "/etc/gpusched/keyring/keys.json" and env["GPUSCHED_CREDS"].endswith("/api.nk")
    assert {v["name"]: v.get("secret", {}).get("secretName") for v in pod["volumes"]}["keyring"] == "gpusched-api-keyring"
    assert ("Service", "api") in kinds and ("NetworkPolicy", "api-http") in kinds
    off = {(d["kind"], d["metadata"]["name"]) for d in _render({"api": {"enabled": False}})}
    assert not {name for _, name in off} & {"api", "api-http"}
    ranks = next(d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "nodeagent-ranks")
    assert {"protocol": "TCP", "port": 29500, "endPort": 39499} in ranks["spec"]["ingress"][0]["ports"]


@needs_helm
def test_every_service_under_a_policy_is_given_the_same_one():
    assert_one_policy([c.get("args", []) for d in _render() for c in containers(d)])


@needs_helm
def test_the_identities_job_runs_first_with_narrow_rbac_and_finds_every_pool():
    docs = _render({"nodeAgent": {"nodePools": [{"name": "h100", "matchLabels": {"gpu": "h100", "zone": "a"}},
                                                {"name": "a100", "matchLabels": {"gpu": "a100"}}]},
                    "bootstrap": {"identities": {"nodes": ["gpu-extra"]}}})
    _validate(docs)
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    job = by[("Job", "gpusched-identities")]
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"  # before NATS mounts nats-auth
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:3] == ["user", "k8s-secrets", "--apply"]
    assert [args[i + 1] for i, a in enumerate(args) if a == "--node-selector"] == ["gpu=h100,zone=a", "gpu=a100"]
    assert args[args.index("--nodes") + 1] == "gpu-extra"
    assert args[args.index("--tls-hosts") + 1] == "nats,nats.gpusched.svc,nats-0.nats,nats-1.nats,nats-2.nats"
    role = by[("Role", "gpusched-identities")]
    assert {v for r in role["rules"] for v in r["verbs"]} == {"create", "get", "update"}  # no list, no delete
    assert [r["verbs"] for r in by[("ClusterRole", "gpusched-gpusched-identities")]["rules"]] == [["list"]]
    # every Secret a pod mounts is one the Job may write
    writable = {n for r in role["rules"] for n in r.get("resourceNames", [])}
    assert {"gpusched-creds", "gpusched-node-creds", "nats-auth", "gpusched-redis", "gpusched-admin", "nats-tls",
            "gpusched-api-keyring"} <= writable
    off = _render({"tls": {"certManager": {"enabled": True}}})
    assert "--tls-hosts" not in next(d for d in off if d["metadata"]["name"] == "gpusched-identities"
                                     and d["kind"] == "Job")["spec"]["template"]["spec"]["containers"][0]["args"]


@needs_helm
def test_redis_with_sentinels_validates_and_every_client_follows_them():
    docs = _render({"redis": {"sentinel": {"enabled": True}}})
    _validate(docs)
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert ("Deployment", "redis") not in by and by[("StatefulSet", "redis")]["spec"]["replicas"] == 3
    pod = by[("StatefulSet", "redis")]["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["redis", "sentinel"]
    script = pod["initContainers"][0]["command"][-1]
    assert "get-master-addr-by-name gpusched" in script  # a restarted pod joins the current master
    urls = [e["value"] for d in docs if d["kind"] == "Deployment" for c in d["spec"]["template"]["spec"]["containers"]
            for e in c.get("env", []) if e["name"] == "GPUSCHED_REDIS_URL"]
    assert len(urls) >= 7 and {u.split("@", 1)[1] for u in urls} == {"redis-sentinel:26379/gpusched/0"}
    with pytest.raises(helm_python.HelmError, match="replicas"):
        _render({"redis": {"sentinel": {"enabled": True, "replicas": 2}}})


@needs_helm
def test_render_with_cert_manager_operator_and_ingress_validates():
    docs = _render({"tls": {"certManager": {"enabled": True}},
                    "dashboard": {"ingress": {"enabled": True, "hosts": ["gpusched.example.com"]}}},
                   api_versions=("monitoring.coreos.com/v1",))
    _validate(docs)
    kinds = {d["kind"] for d in docs}
    assert {"ServiceMonitor", "PrometheusRule", "Certificate", "Issuer", "Ingress"} <= kinds
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    assert any(r.get("alert") == "GpuschedPlacementDegraded" for g in rule["spec"]["groups"] for r in g["rules"])


@needs_helm
@pytest.mark.parametrize(("values", "named"), [
    ({"nats": {"streamReplicas": 2}}, "streamReplicas"),
    ({"networkPolicy": {"rankPorts": {"start": 29500, "end": 70000}}}, "end"),
    ({"nodeAgent": {"nodePools": [{"name": "a100", "labels": {"x": "y"}}]}}, "matchLabels"),
    ({"services": [{"name": "Placement", "run": "placement", "replicas": 1, "args": [], "cpu": "1",
                    "memory": "1Gi", "memoryLimit": "2Gi"}]}, "name"),
])
def test_bad_values_are_refused_naming_the_key(values, named):
    with pytest.raises(helm_python.HelmError, match=named):  # values.schema.json
        _render(values)
