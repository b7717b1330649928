"""Render the Helm chart with Helm's own engine and check the manifests.

Rendering goes through ``helm-python-sdk`` (``helm_python.Chart.load(...).render(values, name=,
namespace=)``), a ctypes binding of Helm's Go SDK: the real template engine, sprig functions,
values coalescing and ``fail`` included, with no ``helm`` binary and no cluster. ``helm_python.lint``
runs ``helm lint`` the same way.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from router.policy.loader import parse_policy

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "tiered-router"
VALUES_MULTI = CHART / "values-gpu-multi.yaml"
DASHBOARD = CHART / "dashboards" / "tiered-router.json"
GPU_POLICY = ROOT / "policies" / "examples" / "gpu-qwen.yaml"
RELEASE = "rel"
NAMESPACE = "llm"
FULLNAME = f"{RELEASE}-tiered-router"
POLICY_DIR = "/etc/tiered-router/policy"
POLICY_PATH = f"{POLICY_DIR}/policy.yaml"
KEYS_DIR = "/etc/tiered-router/keys"

# The only condition under which these tests skip: Helm's engine (the helm-python-sdk wheel and
# its bundled libhelm_c shared library) cannot be imported or loaded on this machine.
try:
    import helm_python

    helm_python.helm_sdk_version()  # loads libhelm_c; raises when no build fits this platform
    HELM_UNAVAILABLE: str | None = None
except ImportError as exc:
    HELM_UNAVAILABLE = (
        f"helm-python-sdk is not installed ({exc}); install it with `.venv/bin/pip install helm-python-sdk`"
    )
except Exception as exc:  # HelmLibraryError / OSError: the native library would not load
    HELM_UNAVAILABLE = f"helm-python-sdk cannot load its native Helm library on this platform: {exc!r}"

needs_helm = pytest.mark.skipif(HELM_UNAVAILABLE is not None, reason=HELM_UNAVAILABLE or "")
pytestmark = needs_helm

# Metric names the service exports (router/telemetry.py); histograms also expose _bucket/_sum/_count.
COUNTERS_AND_GAUGES = {
    "router_requests_total",
    "router_running_requests",
    "router_waiting_requests",
    "router_kv_cache_usage_ratio",
    "router_prompt_tokens_total",
    "router_completion_tokens_total",
    "router_spec_decode_draft_tokens_total",
    "router_spec_decode_accepted_tokens_total",
    "router_spec_decode_steps_total",
    "router_route_decisions_total",
    "router_cache_hits_total",
    "router_cache_misses_total",
    "router_policy_reloads_total",
    "router_policy_reload_failures_total",
    "router_ready",
}
HISTOGRAMS = {
    "router_request_duration_seconds",
    "router_time_to_first_token_seconds",
    "router_inter_token_latency_seconds",
    "router_queue_time_seconds",
    "router_classifier_latency_seconds",
}
KNOWN_SERIES = COUNTERS_AND_GAUGES | {f"{h}_{s}" for h in HISTOGRAMS for s in ("bucket", "sum", "count")}


# -- rendering helpers ------------------------------------------------------------------------------
def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Deep merge like successive ``-f`` files: maps merge, everything else replaces."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


class Rendered:
    """One render: every object by kind, plus NOTES.txt."""

    def __init__(self, manifests: dict[str, str]) -> None:
        self.notes = ""
        self.objects: list[dict[str, Any]] = []
        for path, text in manifests.items():
            if path.endswith("NOTES.txt"):
                self.notes = text
                continue
            for doc in yaml.safe_load_all(text):
                if doc:
                    assert "kind" in doc and "apiVersion" in doc, f"{path}: not a Kubernetes object: {doc}"
                    self.objects.append(doc)

    @property
    def kinds(self) -> set[str]:
        return {o["kind"] for o in self.objects}

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str = FULLNAME) -> dict[str, Any]:
        found = [o for o in self.all(kind) if o["metadata"]["name"] == name]
        assert len(found) == 1, (
            f"expected one {kind} {name}, found {[o['metadata']['name'] for o in self.all(kind)]}"
        )
        return found[0]

    @property
    def deployment(self) -> dict[str, Any]:
        return self.get("Deployment")

    @property
    def pod(self) -> dict[str, Any]:
        spec: dict[str, Any] = self.deployment["spec"]["template"]["spec"]
        return spec

    @property
    def container(self) -> dict[str, Any]:
        (router,) = [c for c in self.pod["containers"] if c["name"] == "router"]
        return router

    @property
    def env(self) -> dict[str, dict[str, Any]]:
        return {e["name"]: e for e in self.container.get("env", [])}

    def volume(self, name: str) -> dict[str, Any]:
        (vol,) = [v for v in self.pod["volumes"] if v["name"] == name]
        return vol

    def mount(self, name: str) -> dict[str, Any]:
        (m,) = [m for m in self.container["volumeMounts"] if m["name"] == name]
        return m


@pytest.fixture(scope="module")
def chart() -> Iterator[Any]:
    with helm_python.Chart.load(CHART) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def multi_values() -> dict[str, Any]:
    # Helm's own YAML loader, exactly what `-f values-gpu-multi.yaml` goes through.
    return helm_python.values_from_yaml(VALUES_MULTI.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def render(chart: Any) -> Callable[..., Rendered]:
    def _render(values: dict[str, Any] | None = None) -> Rendered:
        return Rendered(chart.render(values or {}, name=RELEASE, namespace=NAMESPACE))

    return _render


@pytest.fixture(scope="module")
def default(render: Callable[..., Rendered]) -> Rendered:
    return render()


@pytest.fixture(scope="module")
def multi(render: Callable[..., Rendered], multi_values: dict[str, Any]) -> Rendered:
    return render(multi_values)


@pytest.fixture(params=["default", "multi"])
def each(request: pytest.FixtureRequest) -> Rendered:
    rendered: Rendered = request.getfixturevalue(request.param)
    return rendered


# -- chart-level ------------------------------------------------------------------------------------
def test_chart_metadata(chart: Any) -> None:
    meta = chart.metadata
    assert meta["name"] == "tiered-router"
    assert meta["apiVersion"] == "v2"
    assert meta["appVersion"] == "0.1.0"
    values = chart.values
    assert values["image"]["repository"] == "ghcr.io/tiered-router/tiered-router"


@pytest.mark.parametrize("values_file", [None, VALUES_MULTI], ids=["default", "gpu-multi"])
def test_helm_lint_passes(values_file: Path | None) -> None:
    values = helm_python.values_from_yaml(values_file.read_text(encoding="utf-8")) if values_file else None
    report = helm_python.lint(CHART, values, strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # warnings and errors
    assert not report["errors"] and not problems, report


def test_default_kinds(default: Rendered) -> None:
    assert {"Deployment", "Service", "ConfigMap", "ServiceAccount"} <= default.kinds
    for optional in (
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "ServiceMonitor",
        "PersistentVolumeClaim",
    ):
        assert optional not in default.kinds
    assert [o["metadata"]["name"] for o in default.all("Deployment")] == [FULLNAME]
    assert all(o["metadata"]["namespace"] == NAMESPACE for o in default.objects)


def test_multi_kinds(multi: Rendered) -> None:
    assert {
        "Deployment",
        "Service",
        "ConfigMap",
        "ServiceAccount",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "ServiceMonitor",
        "PersistentVolumeClaim",
    } <= multi.kinds
    assert multi.get("PodDisruptionBudget")["apiVersion"] == "policy/v1"
    assert multi.get("HorizontalPodAutoscaler")["apiVersion"] == "autoscaling/v2"
    assert multi.get("ServiceMonitor")["apiVersion"] == "monitoring.coreos.com/v1"


def test_standard_labels(each: Rendered) -> None:
    for obj in each.objects:
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "tiered-router"
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["helm.sh/chart"] == "tiered-router-0.1.0"
    dep = each.deployment
    selector = dep["spec"]["selector"]["matchLabels"]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= pod_labels.items()
    assert each.get("Service")["spec"]["selector"] == selector


# -- the router container ---------------------------------------------------------------------------
def test_container_command_and_image(each: Rendered) -> None:
    c = each.container
    argv = [*c["command"], *c["args"]]
    assert argv[0] == "tiered-router"
    line = " ".join(argv)
    assert f"serve --policy {POLICY_PATH} --host 0.0.0.0 --port 8080" in line
    assert c["image"] == "ghcr.io/tiered-router/tiered-router:0.1.0"


def test_image_is_configurable(render: Callable[..., Rendered]) -> None:
    r = render({"image": {"repository": "registry.example/router", "tag": "1.2.3"}})
    assert r.container["image"] == "registry.example/router:1.2.3"


def test_ports_service_and_metrics(each: Rendered) -> None:
    assert each.container["ports"] == [
        {"name": "http", "containerPort": 8080, "protocol": "TCP"},
        {"name": "admin", "containerPort": 8081, "protocol": "TCP"},
    ]
    args = each.container["args"]
    assert (
        args[args.index("--admin-port") + 1] == "8081" and args[args.index("--admin-host") + 1] == "0.0.0.0"
    )
    svc = each.get("Service")["spec"]
    assert svc["type"] == "ClusterIP"
    # The API Service carries only the API: operator endpoints never ride on it.
    assert svc["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]
    admin = each.get("Service", f"{FULLNAME}-admin")
    assert admin["spec"]["type"] == "ClusterIP"
    assert admin["spec"]["ports"] == [
        {"name": "admin", "port": 8081, "targetPort": "admin", "protocol": "TCP"}
    ]
    assert admin["metadata"]["labels"]["app.kubernetes.io/component"] == "admin"


def test_service_monitor_scrapes_the_admin_port(multi: Rendered, render: Callable[..., Rendered]) -> None:
    sm = multi.get("ServiceMonitor")
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] == "admin"
    assert endpoint["path"] == "/metrics"
    selector = sm["spec"]["selector"]["matchLabels"]
    admin = multi.get("Service", f"{FULLNAME}-admin")
    assert selector.items() <= admin["metadata"]["labels"].items()
    assert not selector.items() <= multi.get("Service")["metadata"]["labels"].items()  # not the API one
    r = render({"serviceMonitor": {"enabled": True}, "adminPort": 9464})
    assert r.get("Service", f"{FULLNAME}-admin")["spec"]["ports"][0]["port"] == 9464
    assert sm["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE]
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_probes(each: Rendered) -> None:
    c = each.container
    for probe, path in (
        ("startupProbe", "/readyz"),
        ("readinessProbe", "/readyz"),
        ("livenessProbe", "/healthz"),
    ):
        assert c[probe]["httpGet"] == {"path": path, "port": "http"}, probe
    startup = c["startupProbe"]
    # Models load at startup: give them at least 20 minutes before the kubelet gives up.
    assert startup["failureThreshold"] * startup["periodSeconds"] >= 20 * 60


def test_gpu_limit(each: Rendered) -> None:
    assert each.container["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_gpu_count_from_set_flag(render: Callable[..., Rendered]) -> None:
    """`--set resources.limits.nvidia\\.com/gpu=2`, parsed by Helm's own --set parser."""
    r = render(helm_python.parse_set_string("resources.limits.nvidia\\.com/gpu=2"))
    assert r.container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert r.container["resources"]["limits"]["memory"] == "48Gi"  # the rest of the defaults stay


def test_gpu_scheduling_in_multi(multi: Rendered, default: Rendered) -> None:
    pod = multi.pod
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert "podAntiAffinity" in pod["affinity"]
    assert "nodeSelector" not in default.pod
    assert "tolerations" not in default.pod


def test_security_context(each: Rendered) -> None:
    pod, c = each.pod, each.container
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert each.mount("tmp")["mountPath"] == "/tmp"
    assert "emptyDir" in each.volume("tmp")
    assert pod["automountServiceAccountToken"] is False
    assert pod["serviceAccountName"] == FULLNAME
    assert each.get("ServiceAccount")["metadata"]["name"] == FULLNAME


# -- policy -----------------------------------------------------------------------------------------
def test_policy_configmap_mounted_as_directory(each: Rendered) -> None:
    for m in each.container["volumeMounts"]:
        assert "subPath" not in m and "subPathExpr" not in m, f"{m['name']}: subPath mounts never update"
    mount = each.mount("policy")
    assert mount["mountPath"] == POLICY_DIR
    assert mount["readOnly"] is True
    vol = each.volume("policy")
    assert vol["configMap"]["name"] == f"{FULLNAME}-policy"
    assert "items" not in vol["configMap"]  # the whole ConfigMap: policy.yaml lands in POLICY_DIR
    cm = each.get("ConfigMap", f"{FULLNAME}-policy")
    assert set(cm["data"]) == {"policy.yaml"}
    policy = yaml.safe_load(cm["data"]["policy.yaml"])
    assert isinstance(policy, dict)
    assert {"tiers", "routing"} <= policy.keys()
    parse_policy(cm["data"]["policy.yaml"], "rendered ConfigMap")


def test_no_checksum_annotation_on_pods(each: Rendered) -> None:
    """A policy checksum would restart pods on every policy edit instead of hot reloading."""
    annotations = each.deployment["spec"]["template"]["metadata"].get("annotations") or {}
    assert not [k for k in annotations if "checksum" in k.lower()]


def test_values_policy_passes_the_service_validator(chart: Any, multi_values: dict[str, Any]) -> None:
    for values in (chart.values, chart.merge_values(multi_values)):
        policy = parse_policy(values["policy"], "values.yaml policy")
        assert set(policy.tiers) == {"small", "medium", "large"}
        assert policy.service.auth.api_keys_file == f"{KEYS_DIR}/api-keys"


def test_default_policy_is_the_gpu_example(chart: Any, default: Rendered) -> None:
    """values.yaml carries a copy of policies/examples/gpu-qwen.yaml: keep them in sync."""
    example = GPU_POLICY.read_text(encoding="utf-8")
    assert chart.values["policy"] == example
    rendered = default.get("ConfigMap", f"{FULLNAME}-policy")["data"]["policy.yaml"]
    assert yaml.safe_load(rendered) == yaml.safe_load(example)
    assert [line.rstrip() for line in rendered.splitlines()] == example.splitlines()


def test_policy_override_from_file(render: Callable[..., Rendered]) -> None:
    """`--set-file policy=...` with another example policy."""
    text = (ROOT / "policies" / "examples" / "cost-saver.yaml").read_text(encoding="utf-8")
    r = render({"policy": text})
    rendered = r.get("ConfigMap", f"{FULLNAME}-policy")["data"]["policy.yaml"]
    assert yaml.safe_load(rendered) == yaml.safe_load(text)


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ("tiers: [", "not valid YAML"),
        ("- just\n- a list\n", "not valid YAML"),
        ("routing: {rules: []}\n", "must be a mapping with `tiers` and `routing`"),
        ("", "`policy` is empty"),
    ],
)
def test_broken_policy_fails_the_render(chart: Any, policy: str, message: str) -> None:
    with pytest.raises(helm_python.HelmRenderError, match=re.escape(message)):
        chart.render({"policy": policy}, name=RELEASE, namespace=NAMESPACE)


def test_existing_policy_configmap(render: Callable[..., Rendered]) -> None:
    r = render({"existingPolicyConfigMap": "my-policy"})
    assert not [o for o in r.all("ConfigMap") if o["metadata"]["name"].endswith("-policy")]
    assert r.volume("policy")["configMap"]["name"] == "my-policy"
    assert r.mount("policy")["mountPath"] == POLICY_DIR


def test_readme_remote_tier_example_is_valid(render: Callable[..., Rendered]) -> None:
    """The chart README's remote-vLLM example renders and passes the service's validator."""
    readme = (CHART / "README.md").read_text(encoding="utf-8")
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", readme, re.S) if "vllm-large" in b]
    assert len(blocks) == 1
    values = yaml.safe_load(blocks[0])
    policy = parse_policy(values["policy"], "README example")
    large = policy.tiers["large"]
    assert large.is_remote
    assert large.model == "http://vllm-large.models.svc:8000/v1"
    assert large.served_model_name and large.api_key_env == "VLLM_API_KEY"
    r = render(values)
    assert "VLLM_API_KEY" in r.env
    assert yaml.safe_load(r.get("ConfigMap", f"{FULLNAME}-policy")["data"]["policy.yaml"]) == yaml.safe_load(
        values["policy"]
    )


# -- environment ------------------------------------------------------------------------------------
def test_env_default(default: Rendered) -> None:
    env = default.env
    assert env["TIERED_ROUTER_CACHE"]["value"] == "/models/cache"
    assert env["HF_HOME"]["value"] == "/models/hf"
    assert env["OTEL_SERVICE_NAME"]["value"] == FULLNAME
    assert env["OTEL_EXPORTER_OTLP_PROTOCOL"]["value"] == "http/protobuf"
    assert env["OTEL_TRACES_SAMPLER"]["value"] == "parentbased_traceidratio"
    assert float(env["OTEL_TRACES_SAMPLER_ARG"]["value"]) == pytest.approx(0.1)
    # No endpoint configured: the service keeps tracing off.
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in env
    assert "REDIS_URL" not in env
    assert "ROUTER_API_KEYS" not in env
    mount = default.mount("model-cache")
    assert mount["mountPath"] == "/models"
    assert "emptyDir" in default.volume("model-cache")
    assert "WARNING" in default.notes and "redis" in default.notes  # the GPU policy asks for Redis


def test_env_multi(multi: Rendered) -> None:
    env = multi.env
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://jaeger-collector.observability.svc:4318"
    assert float(env["OTEL_TRACES_SAMPLER_ARG"]["value"]) == pytest.approx(0.05)
    assert "deployment.environment=production" in env["OTEL_RESOURCE_ATTRIBUTES"]["value"]
    assert env["REDIS_URL"]["value"].startswith("redis://")
    assert env["TIERED_ROUTER_CACHE"]["value"] == "/models/cache"
    assert "WARNING" not in multi.notes


def test_redis_from_secret_uses_the_policy_env_name(render: Callable[..., Rendered]) -> None:
    policy = GPU_POLICY.read_text(encoding="utf-8").replace(
        "redis_url_env: REDIS_URL", "redis_url_env: CACHE_URL"
    )
    parse_policy(policy)
    r = render({"policy": policy, "redis": {"existingSecret": "redis-creds"}})
    assert r.env["CACHE_URL"]["valueFrom"]["secretKeyRef"] == {"name": "redis-creds", "key": "redis-url"}
    assert "REDIS_URL" not in r.env


def test_model_cache_persistence(multi: Rendered, render: Callable[..., Rendered]) -> None:
    pvc = multi.get("PersistentVolumeClaim", f"{FULLNAME}-models")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["spec"]["resources"]["requests"]["storage"] == "200Gi"
    assert multi.volume("model-cache")["persistentVolumeClaim"]["claimName"] == f"{FULLNAME}-models"
    r = render(
        {"modelCache": {"persistence": {"enabled": True, "existingClaim": "models", "storageClass": "fast"}}}
    )
    assert "PersistentVolumeClaim" not in r.kinds
    assert r.volume("model-cache")["persistentVolumeClaim"]["claimName"] == "models"


def test_state_dir_is_a_writable_volume(
    each: Rendered, render: Callable[..., Rendered], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches a pod whose feedback and shadow logs would land on the read-only root filesystem
    (state_file's fallback is ~/.local/state): the env var the code reads must point at a mount."""
    from router.policy.schema import state_file

    path = each.env["TIERED_ROUTER_STATE_DIR"]["value"]
    mount = each.mount("state")
    assert mount["mountPath"] == path and not mount.get("readOnly", False)
    assert "emptyDir" in each.volume("state")
    assert each.container["securityContext"]["readOnlyRootFilesystem"] is True
    # The service resolves its logs inside that mount (same env var name, independent of the chart).
    monkeypatch.setenv("TIERED_ROUTER_STATE_DIR", path)
    assert state_file("feedback.jsonl").startswith(path + "/")

    r = render({"state": {"persistence": {"enabled": True, "size": "1Gi", "storageClass": "-"}}})
    pvc = r.get("PersistentVolumeClaim", f"{FULLNAME}-state")
    assert pvc["spec"]["resources"]["requests"]["storage"] == "1Gi"
    assert pvc["spec"]["storageClassName"] == ""
    assert r.volume("state")["persistentVolumeClaim"]["claimName"] == f"{FULLNAME}-state"
    r = render({"state": {"persistence": {"enabled": True, "existingClaim": "logs"}}})
    assert "PersistentVolumeClaim" not in r.kinds
    assert r.volume("state")["persistentVolumeClaim"]["claimName"] == "logs"


# -- graceful drain ---------------------------------------------------------------------------------
def _pre_stop_sleep(r: Rendered) -> int:
    cmd = r.container["lifecycle"]["preStop"]["exec"]["command"]
    assert cmd[0] == "sleep"
    return int(cmd[1])


def test_termination_grace_covers_prestop_and_drain(each: Rendered) -> None:
    grace = each.pod["terminationGracePeriodSeconds"]
    policy = yaml.safe_load(each.get("ConfigMap", f"{FULLNAME}-policy")["data"]["policy.yaml"])
    drain = max(60, policy["service"]["drain_timeout_s"])  # drainTimeoutSeconds default is 60
    pre_stop = _pre_stop_sleep(each)
    assert pre_stop == 10
    assert grace > pre_stop + drain
    assert grace == 10 + 60 + 15


def test_policy_drain_longer_than_value_wins(render: Callable[..., Rendered]) -> None:
    policy = GPU_POLICY.read_text(encoding="utf-8").replace("drain_timeout_s: 60", "drain_timeout_s: 120.5")
    parse_policy(policy)
    r = render({"policy": policy, "preStopSleepSeconds": 5})
    assert _pre_stop_sleep(r) == 5
    assert r.pod["terminationGracePeriodSeconds"] == 5 + 121 + 15


def test_explicit_grace_period(render: Callable[..., Rendered], chart: Any) -> None:
    r = render({"terminationGracePeriodSeconds": 300})
    assert r.pod["terminationGracePeriodSeconds"] == 300
    with pytest.raises(helm_python.HelmRenderError, match="terminationGracePeriodSeconds"):
        chart.render({"terminationGracePeriodSeconds": 30}, name=RELEASE, namespace=NAMESPACE)


# -- auth -------------------------------------------------------------------------------------------
def test_no_auth_secret_by_default(default: Rendered) -> None:
    assert not [v for v in default.pod["volumes"] if "secret" in v]
    assert not [m for m in default.container["volumeMounts"] if m["mountPath"] == KEYS_DIR]


def test_auth_secret_mounted_as_directory(multi: Rendered, render: Callable[..., Rendered]) -> None:
    vol = multi.volume("api-keys")
    assert vol["secret"]["secretName"] == "tiered-router-api-keys"
    assert vol["secret"]["items"] == [{"key": "api-keys", "path": "api-keys"}]
    mount = multi.mount("api-keys")
    assert mount["mountPath"] == KEYS_DIR
    assert "subPath" not in mount
    assert "ROUTER_API_KEYS" not in multi.env
    assert "Authorization: Bearer" in multi.notes

    r = render({"auth": {"existingSecret": "keys", "secretKey": "tokens", "env": True}})
    assert r.volume("api-keys")["secret"]["items"] == [{"key": "tokens", "path": "api-keys"}]
    assert r.env["ROUTER_API_KEYS"]["valueFrom"]["secretKeyRef"] == {"name": "keys", "key": "tokens"}


def test_admin_keys_secret_mounted_and_passed(default: Rendered, render: Callable[..., Rendered]) -> None:
    """Catches the admin-keys Secret mounted but never handed to ``serve`` (admin actions would stay
    closed), or passed without its mount; and by default neither (admin actions closed, 403)."""
    assert "--admin-keys-file" not in default.container["args"]
    r = render({"adminKeys": {"existingSecret": "ops-keys", "secretKey": "k"}})
    assert r.volume("admin-keys")["secret"] == {
        "secretName": "ops-keys",
        "defaultMode": 0o440,
        "items": [{"key": "k", "path": "admin-keys"}],
    }
    mount = r.mount("admin-keys")
    args = r.container["args"]
    path = args[args.index("--admin-keys-file") + 1]
    assert path == mount["mountPath"] + "/admin-keys" and "subPath" not in mount
    assert args[args.index("--admin-host") + 1] == "0.0.0.0"  # set explicitly for the scraper


# -- scaling and disruption -------------------------------------------------------------------------
def test_replicas_and_hpa(default: Rendered, multi: Rendered) -> None:
    assert default.deployment["spec"]["replicas"] == 1
    assert "replicas" not in multi.deployment["spec"]  # the HPA owns the count
    hpa = multi.get("HorizontalPodAutoscaler")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": FULLNAME}
    assert hpa["minReplicas"] == 3
    assert hpa["maxReplicas"] >= 3
    (metric,) = hpa["metrics"]  # the CPU target is nulled in values-gpu-multi.yaml
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == "router_waiting_requests"
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "8"}


def test_hpa_cpu_target(render: Callable[..., Rendered], chart: Any) -> None:
    r = render({"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 5}})
    (metric,) = r.get("HorizontalPodAutoscaler")["spec"]["metrics"]
    assert metric["resource"] == {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 80}}
    with pytest.raises(helm_python.HelmRenderError, match="maxReplicas"):
        chart.render({"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}, name=RELEASE)


def test_pdb(multi: Rendered, render: Callable[..., Rendered]) -> None:
    pdb = multi.get("PodDisruptionBudget")["spec"]
    assert pdb["maxUnavailable"] == 1
    assert "minAvailable" not in pdb
    assert pdb["selector"]["matchLabels"] == multi.deployment["spec"]["selector"]["matchLabels"]
    pdb = render({"pdb": {"enabled": True}}).get("PodDisruptionBudget")["spec"]
    assert pdb["minAvailable"] == 1
    assert "maxUnavailable" not in pdb


# -- tracing ----------------------------------------------------------------------------------------
def test_jaeger_only_when_enabled(default: Rendered, multi: Rendered) -> None:
    for r in (default, multi):
        assert not [o for o in r.objects if "jaeger" in o["metadata"]["name"]]


def test_jaeger_enabled(render: Callable[..., Rendered]) -> None:
    r = render({"jaeger": {"enabled": True}})
    name = f"{FULLNAME}-jaeger"
    dep = r.get("Deployment", name)
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["image"].startswith("jaegertracing/all-in-one:")
    assert {p["containerPort"] for p in c["ports"]} == {16686, 4317, 4318}
    svc = r.get("Service", name)
    assert {p["port"] for p in svc["spec"]["ports"]} == {16686, 4317, 4318}
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    # The router's pods and Jaeger's never match each other's selectors.
    router_selector = r.deployment["spec"]["selector"]["matchLabels"]
    jaeger_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert not router_selector.items() <= jaeger_labels.items()
    # No explicit endpoint: the router exports to the bundled Jaeger over OTLP/HTTP.
    assert r.env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == f"http://{name}.{NAMESPACE}.svc:4318"
    assert "16686" in r.notes
    # An explicit endpoint wins.
    r = render({"jaeger": {"enabled": True}, "otel": {"endpoint": "http://collector:4318"}})
    assert r.env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://collector:4318"


# -- NOTES ------------------------------------------------------------------------------------------
def test_notes_explain_how_to_call(each: Rendered) -> None:
    notes = each.notes
    assert f"port-forward svc/{FULLNAME} 8080:80" in notes
    assert "/v1/chat/completions" in notes
    assert '"model": "auto"' in notes
    assert 'base_url="http://127.0.0.1:8080/v1"' in notes


# -- Grafana dashboard ------------------------------------------------------------------------------
def _dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return data


def _all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in panels:
        yield p
        yield from _all_panels(p.get("panels", []))


_PROMQL_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
}


def promql_series(expr: str) -> set[str]:
    """Metric names an expression selects (a small PromQL scanner, enough for dashboard queries)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    s = re.sub(r"\$\{\w+(?::\w+)?\}|\$\w+", "", s)  # Grafana variables
    s = re.sub(r"\{[^}]*\}", "", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", "", s)  # range selectors
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)  # label lists
    names = set()
    for m in re.finditer(r"(?<![\w.])([a-zA-Z_:][\w:]*)", s):
        name, rest = m.group(1), s[m.end() :].lstrip()
        if rest.startswith("(") or name.lower() in _PROMQL_KEYWORDS:
            continue  # a function call or an operator keyword
        names.add(name)
    return names


def test_promql_scanner() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le, tier) (rate(router_queue_time_seconds_bucket{tier=~"$tier"}'
        "[$__rate_interval]))) / on (tier) group_left sum(router_ready) > bool 0"
    )
    assert promql_series(expr) == {"router_queue_time_seconds_bucket", "router_ready"}


def test_dashboard_json_and_metrics() -> None:
    dash = _dashboard()
    assert dash["uid"] == "tiered-router"
    exprs: list[str] = []
    for panel in _all_panels(dash["panels"]):
        for target in panel.get("targets", []):
            exprs.append(target["expr"])
    for var in dash["templating"]["list"]:
        query = var.get("query")
        if isinstance(query, dict):
            query = query.get("query")
        if isinstance(query, str) and query.startswith("label_values("):
            m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", query)
            assert m, query
            exprs.append(m.group(1))
    assert len(exprs) >= 20
    used: set[str] = set()
    for expr in exprs:
        series = promql_series(expr)
        assert series, f"no metric in {expr!r}"
        unknown = series - KNOWN_SERIES
        assert not unknown, f"{expr!r} uses metrics the service does not export: {unknown}"
        used |= series
    # The panels the operators asked for are all there.
    for needed in (
        "router_requests_total",
        "router_route_decisions_total",
        "router_time_to_first_token_seconds_bucket",
        "router_request_duration_seconds_bucket",
        "router_inter_token_latency_seconds_bucket",
        "router_queue_time_seconds_bucket",
        "router_running_requests",
        "router_waiting_requests",
        "router_spec_decode_accepted_tokens_total",
        "router_spec_decode_draft_tokens_total",
        "router_completion_tokens_total",
        "router_cache_hits_total",
        "router_cache_misses_total",
        "router_classifier_latency_seconds_bucket",
        "router_policy_reloads_total",
        "router_policy_reload_failures_total",
    ):
        assert needed in used, needed


def test_dashboard_panels_are_well_formed() -> None:
    dash = _dashboard()
    ids = [p["id"] for p in _all_panels(dash["panels"])]
    assert len(ids) == len(set(ids))
    for p in _all_panels(dash["panels"]):
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}"
        assert p["targets"] and all(t["refId"] for t in p["targets"])
        assert {"h", "w", "x", "y"} <= p["gridPos"].keys() and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24


def test_dashboard_configmap(multi: Rendered, default: Rendered) -> None:
    cm = multi.get("ConfigMap", f"{FULLNAME}-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["tiered-router.json"]) == _dashboard()
    assert not [o for o in default.all("ConfigMap") if o["metadata"]["name"].endswith("-dashboard")]


# -- values documentation ---------------------------------------------------------------------------
def undocumented_values(text: str) -> list[str]:
    """Leaf keys of a values file without a comment.

    A key is documented by the comment line right above it. A ``# -- `` comment documents the
    whole block under its key (pass-through Kubernetes objects such as resources or probes); a
    plain comment above a group key does not excuse its children. The block scalar under
    ``policy: |`` is policy content, not chart values.
    """
    missing: list[str] = []
    stack: list[tuple[int, str, bool]] = []  # (indent, key, documents its whole block)
    prev = ""  # the line above
    doc_whole = False  # the comment run right above holds a "# --" line
    block_indent: int | None = None  # inside a block scalar deeper than this indent
    for raw in text.splitlines():
        indent = len(raw) - len(raw.lstrip(" "))
        stripped = raw.strip()
        if block_indent is not None:
            if not stripped or indent > block_indent:
                continue
            block_indent = None
        if not stripped:
            prev, doc_whole = "", False
            continue
        m = re.match(r"([\w.\-\"/]+):(?:\s+(.*))?$", stripped)
        if stripped.startswith("#"):
            doc_whole = (doc_whole and prev.startswith("#")) or stripped.startswith("# --")
            prev = stripped
            continue
        if stripped.startswith("- ") or not m:
            prev, doc_whole = stripped, False
            continue
        key, rest = m.group(1), (m.group(2) or "").split(" #")[0].strip()
        while stack and stack[-1][0] >= indent:
            stack.pop()
        commented = prev.startswith("#")
        covered = any(whole for _, _, whole in stack)
        is_leaf = rest != ""
        if is_leaf and not commented and not covered:
            missing.append(".".join([*(k for _, k, _ in stack), key]))
        stack.append((indent, key, commented and doc_whole))
        if rest in ("|", "|-", ">", ">-"):
            block_indent = indent
        prev, doc_whole = stripped, False
    return missing


def test_every_value_is_documented() -> None:
    assert undocumented_values("a: 1\n# -- doc\nb: 2\n# group\ng:\n  c: 3\n# -- whole\nw:\n  d: 4\n") == [
        "a",
        "g.c",
    ]
    for path in (CHART / "values.yaml", VALUES_MULTI):
        assert undocumented_values(path.read_text(encoding="utf-8")) == [], path.name
