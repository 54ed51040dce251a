"""The Helm chart with the real helm: lint, render, values schema, CRD and RBAC equal to their sources."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
import yaml
from contract_tools import (
    CHART,
    CI_VALUES,
    CRD_FILE,
    NAMESPACE,
    REPO,
    find_obj,
    helm_template_argv,
    load_crd,
    render,
    require_tool,
    run,
)

VALUE_SETS = {"default": (), "ci": ("-f", str(CI_VALUES)), "namespace": ("--set", "scope=namespace")}


@pytest.fixture(scope="module")
def helm() -> str:
    return require_tool("helm")


@pytest.mark.parametrize("values", VALUE_SETS)
def test_helm_lint_strict(helm: str, values: str) -> None:
    run([helm, "lint", "--strict", str(CHART), *VALUE_SETS[values]])


@pytest.mark.parametrize("values", VALUE_SETS)
def test_operator_deployment_is_hardened(helm: str, values: str) -> None:
    dep = find_obj(render(helm, *VALUE_SETS[values]), "Deployment")
    spec = dep["spec"]
    assert spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    sec = container["securityContext"]
    assert sec["readOnlyRootFilesystem"] is True
    assert sec["allowPrivilegeEscalation"] is False
    assert sec["capabilities"]["drop"] == ["ALL"]
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/tmp"}
    # Both probes hit Kopf's liveness endpoint on the port the operator is told to serve it on.
    env = {e["name"]: e.get("value") for e in container["env"]}
    (port,) = container["ports"]
    assert env["CONFKV_LIVENESS_PORT"] == str(port["containerPort"])
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": port["name"]}
    assert not container["image"].endswith(":latest") and ":" in container["image"]


def test_default_values_run_one_standalone_replica(helm: str) -> None:
    objs = render(helm)
    dep = find_obj(objs, "Deployment")
    assert dep["spec"]["replicas"] == 1
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert "command" not in container, "one replica uses the image's entrypoint"
    env = {e["name"] for e in container["env"]}
    assert "CONFKV_PEERING_NAME" not in env, "without peering Kopf runs standalone"
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objs}
    assert not any(name.endswith("kopf.dev") or kind == "ClusterKopfPeering" for kind, name in kinds)


def test_operator_settings_env_matches_the_operator(helm: str) -> None:
    """Every CONFKV_* variable the chart sets is a setting the operator reads (or the chart's own base)."""
    sys.path.insert(0, str(REPO / "operator"))
    from confkv_operator.settings import ENV_PREFIX, OperatorSettings, load_settings

    known = {ENV_PREFIX + name.upper() for name in OperatorSettings.model_fields}
    for values in VALUE_SETS.values():
        container = find_obj(render(helm, *values), "Deployment")["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        chart_only = {"CONFKV_PEERING_BASE_PRIORITY", "CONFKV_EXTRA"}
        chart_env = {k for k in env if k.startswith(ENV_PREFIX)} - chart_only
        assert chart_env <= known, f"unknown operator settings: {chart_env - known}"
        load_settings(env)  # the rendered values pass the operator's own start-up validation


def test_replicas_above_one_use_peering_with_distinct_priorities(helm: str) -> None:
    objs = render(helm, "-f", str(CI_VALUES))
    assert find_obj(objs, "Deployment")["spec"]["replicas"] > 1
    find_obj(objs, "CustomResourceDefinition", "clusterkopfpeerings.kopf.dev")
    peering = find_obj(objs, "ClusterKopfPeering")
    assert "post-install" in peering["metadata"]["annotations"]["helm.sh/hook"]
    role = find_obj(objs, "ClusterRole")
    assert {"apiGroups": ["kopf.dev"], "resources": ["clusterkopfpeerings"],
            "verbs": ["get", "list", "patch", "watch"]} in role["rules"]
    container = find_obj(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["CONFKV_PEERING_NAME"] == peering["metadata"]["name"]
    # Run the container's own shell snippet for two pod names: the priorities must differ.
    script = container["command"][-1].replace("exec confkv-operator", 'echo "$CONFKV_PEERING_PRIORITY"')
    priorities = set()
    for pod in ("confkv-operator-ci-7d9f8b6c5d-abcde", "confkv-operator-ci-7d9f8b6c5d-fghij"):
        out = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, check=True, env={
            "POD_NAME": pod, "CONFKV_PEERING_BASE_PRIORITY": env["CONFKV_PEERING_BASE_PRIORITY"],
            "PATH": "/usr/bin:/bin"})
        priorities.add(int(out.stdout))
    assert len(priorities) == 2 and min(priorities) >= int(env["CONFKV_PEERING_BASE_PRIORITY"])


@pytest.mark.parametrize("values", VALUE_SETS)
def test_chart_crd_spec_equals_crds_dir(helm: str, values: str) -> None:
    source = load_crd()
    objs = render(helm, *VALUE_SETS[values])
    rendered = find_obj(objs, "CustomResourceDefinition", source["metadata"]["name"])
    assert rendered["spec"] == source["spec"]
    # Helm never upgrades a chart's crds/ directory: the CRD must be a template, kept on uninstall.
    assert rendered["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert not (CHART / "crds").exists(), "a chart crds/ directory would never be upgraded"


def test_chart_copies_are_fresh() -> None:
    """The chart's files/crds and files/rbac are generated from crds/ and rbac.py (scripts/sync-chart.py)."""
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "sync-chart.py"), "--check"],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (CHART / "files" / "crds" / CRD_FILE.name).read_bytes() == CRD_FILE.read_bytes()


def test_crds_install_false_renders_no_crd(helm: str) -> None:
    objs = render(helm, "--set", "crds.install=false")
    assert not [o for o in objs if o["kind"] == "CustomResourceDefinition"]


def test_cluster_role_equals_operator_rules(helm: str) -> None:
    sys.path.insert(0, str(REPO / "operator"))
    from confkv_operator.rbac import OPERATOR_RULES

    role = find_obj(render(helm), "ClusterRole")
    assert role["rules"] == OPERATOR_RULES, (
        "chart ClusterRole differs from OPERATOR_RULES; run `python scripts/sync-chart.py`\n"
        + yaml.safe_dump(OPERATOR_RULES)
    )
    binding = find_obj(render(helm), "ClusterRoleBinding")
    account = find_obj(render(helm), "ServiceAccount")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": account["metadata"]["namespace"]}]
    pod = find_obj(render(helm), "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]


@pytest.mark.parametrize("bad", [
    ("--set", "replicaCount=0"),
    ("--set", "image.tag=latest"),
    ("--set", "operator.logLevel=LOUD"),
    ("--set", "unknownKey=1"),
    ("--set", "operator.livenessPort=80"),
    ("--set", "serviceMonitor.interval=soon"),
    ("--set", "scope=tenant"),
    ("--set", "scope=namespace", "--set", "operator.watchNamespaces={a}"),
    ("--set", "scope=namespace", "--set", "replicaCount=2"),
    ("--set", "operator.hostPathPrefixes={/}"),
    ("--set", "operator.hostPathPrefixes={/data/../etc}"),
    ("--set", "operator.hostPathPrefixes={data}"),
])
def test_values_schema_rejects_bad_values(helm: str, bad: tuple[str, ...]) -> None:
    proc = run(helm_template_argv(helm, *bad), check=False)
    assert proc.returncode != 0, f"helm accepted {bad}"
    assert "schema" in proc.stderr.lower(), proc.stderr


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        both = isinstance(value, dict) and isinstance(base.get(key), dict)
        out[key] = _merge(base[key], value) if both else value
    return out


def test_values_files_match_the_schema() -> None:
    """values.yaml, and the CI values merged over it as helm does, validate against values.schema.json."""
    import jsonschema

    schema = json.loads((CHART / "values.schema.json").read_text())
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.validate(defaults, schema)
    jsonschema.validate(_merge(defaults, yaml.safe_load(CI_VALUES.read_text())), schema)


def _exprs(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_dashboard_covers_every_metric(helm: str) -> None:
    from confkv_api import metrics

    cm = find_obj(render(helm), "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["confkv.json"])
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    text = "\n".join(_exprs(dashboard))
    names = [v for k, v in vars(metrics).items() if k.isupper() and isinstance(v, str)]
    missing = [n for n in names if n not in text]
    assert not missing, f"dashboard has no panel for {missing}"


def test_service_monitor_selects_operator_metrics_services(helm: str) -> None:
    sys.path.insert(0, str(REPO / "operator"))
    from confkv_api.deployment import DeploymentSpec
    from confkv_operator.network import build_metrics_service, build_service
    from confkv_operator.settings import OperatorSettings

    monitor = find_obj(render(helm, "-f", str(CI_VALUES)), "ServiceMonitor")
    service = build_metrics_service("demo", DeploymentSpec(), OperatorSettings())
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    # The API Service is not scraped (no double scrape of the engine).
    assert not selector.items() <= build_service("demo", DeploymentSpec())["metadata"]["labels"].items()
    ports = {p["name"] for p in service["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} == ports


def test_gpu_example_renders_with_the_charts_cuda_engine_image(helm: str) -> None:
    """The chart's operator settings, applied to examples/gpu-32b.yaml, give its engine the CUDA image."""
    sys.path.insert(0, str(REPO / "operator"))
    from confkv_api.deployment import load_deployment_spec
    from confkv_operator.pod import build_deployment
    from confkv_operator.settings import load_settings

    example = yaml.safe_load((REPO / "examples" / "gpu-32b.yaml").read_text())
    spec = load_deployment_spec(example["spec"])
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    for extra, image in (((), f"ghcr.io/confkv/confkv:{app_version}-cuda"),
                         (("--set", "operator.engineCudaImage=registry.local/confkv:9-cuda"),
                          "registry.local/confkv:9-cuda")):
        settings = load_settings(_operator_env(render(helm, *extra)))
        pod = build_deployment("qwen", spec, settings)["spec"]["template"]["spec"]
        engine = next(c for c in pod["containers"] if c["name"] == "confkv-engine")
        assert engine["image"] == image
        assert pod["initContainers"][0]["image"] == image  # the download runs from the same image
        agent = next(c for c in pod["initContainers"] if c["name"] == "confkv-agent")
        assert agent["image"] == settings.engine_image  # the agent needs no CUDA


def test_monitoring_labels_reach_the_operator(helm: str) -> None:
    sys.path.insert(0, str(REPO / "operator"))
    from confkv_operator.settings import load_settings

    assert load_settings(_operator_env(render(helm))).monitoring_labels == {}
    env = _operator_env(render(helm, "--set", "operator.monitoringLabels.release=kube-prometheus-stack"))
    assert load_settings(env).monitoring_labels == {"release": "kube-prometheus-stack"}


@pytest.mark.parametrize("values", VALUE_SETS)
def test_notes_render(helm: str, values: str) -> None:
    """NOTES.txt only renders on install: a client-side dry run needs no cluster."""
    proc = run([helm, "install", "confkv", str(CHART), "--dry-run=client", "--namespace", "confkv-system",
                *VALUE_SETS[values]])
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert "<no value>" not in notes
    assert "kubectl apply -f examples/" in notes
    example = notes.split("kubectl apply -f ", 1)[1].split()[0]
    assert (REPO / example).is_file(), f"NOTES points at a missing example {example}"


def _operator_env(objs: list[dict[str, Any]]) -> dict[str, str]:
    container = find_obj(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


#: Kinds that exist outside namespaces: a namespaced install's Role must name none of them.
CLUSTER_SCOPED_RESOURCES = {"namespaces", "nodes", "persistentvolumes", "customresourcedefinitions",
                            "clusterroles", "clusterrolebindings", "clusterkopfpeerings",
                            "validatingadmissionpolicies", "validatingadmissionpolicybindings"}


def test_namespace_scope_uses_a_role_and_watches_only_the_release_namespace(helm: str) -> None:
    sys.path.insert(0, str(REPO / "operator"))
    from confkv_operator.rbac import OPERATOR_NAMESPACE_RULES
    from confkv_operator.settings import load_settings

    objs = render(helm, "--set", "scope=namespace")
    kinds = {o["kind"] for o in objs}
    assert not kinds & {"ClusterRole", "ClusterRoleBinding"}
    role, binding = find_obj(objs, "Role"), find_obj(objs, "RoleBinding")
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == OPERATOR_NAMESPACE_RULES
    named = {r for rule in role["rules"] for r in rule["resources"]}
    assert not named & CLUSTER_SCOPED_RESOURCES
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    env = _operator_env(objs)
    assert (env["CONFKV_NAMESPACES"], env["CONFKV_WATCH_SCOPE"]) == (NAMESPACE, "namespace")
    settings = load_settings(env)
    assert settings.namespaces == (NAMESPACE,) and not settings.scans_cluster


def test_cluster_scope_with_a_namespace_list_may_scan_namespaces(helm: str) -> None:
    sys.path.insert(0, str(REPO / "operator"))
    from confkv_operator.rbac import NAMESPACE_SCAN_RULES, OPERATOR_RULES, expand

    listed = find_obj(render(helm, "--set", "operator.watchNamespaces={ml-*}"), "ClusterRole")
    assert expand(listed["rules"]) == expand(OPERATOR_RULES) | expand(NAMESPACE_SCAN_RULES)
    everywhere = find_obj(render(helm), "ClusterRole")
    assert not expand(everywhere["rules"]) & expand(NAMESPACE_SCAN_RULES)


def test_host_path_prefixes_reach_the_operator(helm: str) -> None:
    sys.path.insert(0, str(REPO / "operator"))
    from confkv_operator.settings import load_settings

    assert load_settings(_operator_env(render(helm))).host_path_prefixes == ()
    env = _operator_env(render(helm, "--set", "operator.hostPathPrefixes={/mnt/nvme/,/data}"))
    assert load_settings(env).host_path_prefixes == ("/mnt/nvme", "/data")
