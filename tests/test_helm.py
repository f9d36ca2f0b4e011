"""The Helm chart (deploy/helm/kvgate) rendered offline: no Kubernetes cluster runs here.

`helm lint --strict` and `helm template` with each example values file (deploy/helm/examples), at
the chart's oldest Kubernetes (1.29) and the newest the validator ships (1.37); every rendered
object validated against that version's OpenAPI schemas in strict mode (`kubernetes-validate`,
unknown fields refused), and the two CRD kinds against their CRDs' schemas (tests/k8s_crd_schemas).
Then the rendered objects themselves: kvgate loads the rendered config, tenants and environment as
a pod would see them; probes, drain timing, PDB arithmetic, HPA bounds, security context, the
worker count wired to the CPU limit, and that no secret value appears outside a Secret.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml

from config.loader import load_settings, load_tenants
from gateway.edge import workers as wk

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "kvgate"
EXAMPLES = sorted((ROOT / "deploy" / "helm" / "examples").glob("values-*.yaml"))
EXAMPLE_NAMES = [p.stem.removeprefix("values-") for p in EXAMPLES]
#: the chart's kubeVersion floor and the newest Kubernetes kubernetes-validate 1.37 ships
KUBE_VERSIONS = ("1.29.0", "1.37.0")
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring-v1.json",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute-gateway-v1.json",
}
RELEASE = "kv"
FULLNAME = "kv-kvgate"


def _helm() -> str:
    local = ROOT / ".tools" / "bin" / "helm"
    exe = str(local) if local.exists() else shutil.which("helm")
    assert exe, "helm is missing: scripts/ensure_tools.sh installs the pinned one into .tools/bin"
    return exe


def _run_helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_helm(), *args], capture_output=True, text=True, timeout=60, cwd=ROOT)


@functools.cache
def _render_text(values: tuple[str, ...], sets: tuple[str, ...] = (), kube: str = KUBE_VERSIONS[-1]) -> str:
    args = ["template", RELEASE, str(CHART), "--namespace", "llm", "--kube-version", kube]
    for v in values:
        args += ["-f", v]
    for s in sets:
        args += ["--set-json", s[5:]] if s.startswith("json:") else ["--set", s]
    out = _run_helm(*args)
    assert out.returncode == 0, out.stderr
    return out.stdout


def render(example: str, *sets: str, kube: str = KUBE_VERSIONS[-1]) -> list[dict[str, Any]]:
    """The objects `helm template` renders for examples/values-<example>.yaml plus `--set`s."""
    path = str(ROOT / "deploy" / "helm" / "examples" / f"values-{example}.yaml")
    return [d for d in yaml.safe_load_all(_render_text((path,), tuple(sets), kube)) if d]


def render_fails(example: str, *sets: str) -> str:
    """helm's error output for a render that must be refused."""
    path = str(ROOT / "deploy" / "helm" / "examples" / f"values-{example}.yaml")
    args = ["template", RELEASE, str(CHART), "-f", path]
    for s in sets:
        args += ["--set-json", s[5:]] if s.startswith("json:") else ["--set", s]
    out = _run_helm(*args)
    assert out.returncode != 0, f"rendered although it must be refused: {sets}"
    return out.stderr


def one(objs: list[dict[str, Any]], kind: str, name: str = FULLNAME) -> dict[str, Any]:
    (found,) = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def gateway_container(objs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]


def env_of(container: dict[str, Any]) -> list[dict[str, Any]]:
    return container.get("env", [])


def secret_data(objs: list[dict[str, Any]]) -> dict[tuple[str, str], str]:
    """{(secret name, key): decoded value} of every rendered Secret."""
    out = {}
    for o in objs:
        if o["kind"] == "Secret":
            for k, v in (o.get("data") or {}).items():
                out[(o["metadata"]["name"], k)] = base64.b64decode(v).decode()
    return out


def pod_environment(objs: list[dict[str, Any]], external: dict[tuple[str, str], str]) -> dict[str, str]:
    """The gateway container's environment as the kubelet builds it: secretKeyRef values from
    the rendered Secrets or ``external`` (Secrets the user creates), then $(NAME) references to
    variables defined earlier filled in (Kubernetes' dependent environment variables)."""
    secrets = {**secret_data(objs), **external}
    env: dict[str, str] = {}
    for e in env_of(gateway_container(objs)):
        if "valueFrom" in e:
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = secrets[(ref["name"], ref["key"])]
        else:
            env[e["name"]] = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), e["value"])
    return env


# ---------------------------------------------------------------------------------------- lint and schemas


def test_examples_exist() -> None:
    assert EXAMPLE_NAMES == ["bundled-backend", "cluster", "minimal", "sentinel"]


@pytest.mark.parametrize("example", EXAMPLE_NAMES)
def test_helm_lint_strict(example: str) -> None:
    out = _run_helm("lint", "--strict", str(CHART), "-f", str(EXAMPLES[EXAMPLE_NAMES.index(example)]))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in out.stdout


@functools.cache
def _crd_validator(name: str) -> jsonschema.Draft202012Validator:
    schema = json.loads((Path(__file__).parent / "k8s_crd_schemas" / name).read_text())
    return jsonschema.Draft202012Validator(schema)


@pytest.fixture(scope="module")
def schema_cache() -> Any:
    """kubernetes-validate reads the same schema files for every object: read each once."""
    utils = kubernetes_validate.utils
    original = utils.schema_contents
    utils.schema_contents = functools.cache(original)
    yield
    utils.schema_contents = original


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
@pytest.mark.parametrize("example", EXAMPLE_NAMES)
def test_every_object_validates(example: str, kube: str, schema_cache: Any) -> None:
    objs = render(example, kube=kube)
    for o in objs:
        where = f"{o['kind']}/{o['metadata']['name']}"
        crd = CRD_SCHEMAS.get((o["apiVersion"], o["kind"]))
        if crd:
            errors = [e.message for e in _crd_validator(crd).iter_errors(o)]
            assert not errors, (where, errors)
        else:
            try:
                kubernetes_validate.validate(o, kube, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{where} at Kubernetes {kube}: {e}")
    kinds = sorted({o["kind"] for o in objs})
    expected = {
        "ConfigMap",
        "Deployment",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "Secret",
        "Service",
        "ServiceAccount",
    }
    assert expected <= set(kinds), kinds


def test_crd_schema_refuses_a_wrong_field() -> None:
    """The bundled CRD schemas are strict: a misspelt field of a ServiceMonitor is an error."""
    sm = one(render("sentinel"), "ServiceMonitor")
    sm = json.loads(json.dumps(sm))
    sm["spec"]["endpoints"][0]["intervall"] = "30s"
    errors = list(_crd_validator(CRD_SCHEMAS[("monitoring.coreos.com/v1", "ServiceMonitor")]).iter_errors(sm))
    assert errors and "intervall" in errors[0].message


def test_prestop_follows_the_kube_version() -> None:
    """The preStop sleep action is on by default from Kubernetes 1.30 (beta); before, `exec: sleep`."""
    old = gateway_container(render("minimal", kube="1.29.0"))["lifecycle"]["preStop"]
    new = gateway_container(render("minimal", kube="1.37.0"))["lifecycle"]["preStop"]
    assert old == {"exec": {"command": ["sleep", "5"]}}
    assert new == {"sleep": {"seconds": 5}}


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
def test_strict_validation_refuses_an_unknown_field(kube: str, schema_cache: Any) -> None:
    """Validation is strict: a misspelt field deep in the pod template is an error."""
    dep = json.loads(json.dumps(one(render("minimal", kube=kube), "Deployment")))
    dep["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["periodSecond"] = 5
    with pytest.raises(kubernetes_validate.ValidationError, match="periodSecond"):
        kubernetes_validate.validate(dep, kube, strict=True)


def test_values_schema_refuses_typos_and_chart_owned_keys() -> None:
    assert "additional properties 'replicaCuont' not allowed" in render_fails("minimal", "replicaCuont=2")
    assert "'redis_url' not allowed" in render_fails("minimal", "config.redis_url=redis://r:6379")
    assert "at '/config/gateway': 'not' failed" in render_fails("minimal", "config.gateway.port=9000")
    assert "minimum: got 0, want 1" in render_fails("minimal", "autoscaling.minReplicas=0")
    assert "at '/redis/mode': value must be one of" in render_fails("minimal", "redis.mode=sentinal")
    # a pod label the chart owns: relabelled off its selector, a pod is no longer the Deployment's
    for key in ("name", "instance", "component", "version", "managed-by"):
        err = render_fails("minimal", f"podLabels.app\\.kubernetes\\.io/{key}=other")
        assert f"invalid propertyName 'app.kubernetes.io/{key}'" in err
    deployment = one(render("minimal", "podLabels.team=inference"), "Deployment")
    labels, selector = deployment["spec"]["template"]["metadata"]["labels"], deployment["spec"]["selector"]
    assert labels["team"] == "inference" and selector["matchLabels"].items() <= labels.items()
    # an engine's key inline in values is refused: it would land in the ConfigMap
    assert "additional properties 'api_key' not allowed" in render_fails("minimal", "upstreams[0].api_key=sk-inline")
    assert "at '/extraEnv/0': 'not' failed" in render_fails(
        "minimal", 'json:extraEnv=[{"name": "HF_TOKEN", "value": "hf_inline"}]'
    )
    ref = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    assert ref in env_of(gateway_container(render("minimal", "json:extraEnv=" + json.dumps([ref]))))


# ---------------------------------------------------------------------------------------- kvgate reads it


EXTERNAL = {  # Secrets the examples name and the user creates (values the chart never sees)
    ("kvgate-redis", "redis-password"): "redis-pass-0123456789",
    ("kvgate-redis", "sentinel-password"): "sentinel-pass-0123456789",
    ("sglang-api-key", "api-key"): "sk-engine-0123456789",
}


def _loaded(example: str, tmp_path: Path) -> tuple[Any, Any, dict[str, str]]:
    objs = render(example)
    config = tmp_path / "kvgate.yaml"
    config.write_text(one(objs, "ConfigMap")["data"]["kvgate.yaml"])
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(secret_data(objs)[(f"{FULLNAME}-tenants", "tenants.yaml")])
    env = pod_environment(objs, EXTERNAL)
    return load_settings(config, environ=env), load_tenants(tenants), env


@pytest.mark.parametrize("example", EXAMPLE_NAMES)
def test_kvgate_loads_the_rendered_config(example: str, tmp_path: Path) -> None:
    settings, tenants, env = _loaded(example, tmp_path)
    objs = render(example)
    container = gateway_container(objs)
    args = container["args"]
    workers = int(args[args.index("--workers") + 1])
    assert settings.gateway.workers == workers
    assert settings.gateway.port == container["ports"][0]["containerPort"] == 8080
    assert wk.workers_refusal(workers, settings) is None
    assert settings.state_dir == "/var/lib/kvgate/data/state"
    assert settings.gateway.metrics_token is not None
    assert settings.gateway.metrics_token.get_secret_value() == env["KVGATE_GATEWAY__METRICS_TOKEN"]
    for name in ("CACHE_SALT_KEY", "LEAK_INDEX_KEY", "ADMIN_KEY"):
        assert len(env[f"KVGATE_SECRET_{name}"].encode()) >= 16
    # the first tenant's key (in the chart's Secret) is the one tenants.yaml holds the hash of
    key = secret_data(objs)[(f"{FULLNAME}-secrets", "first-tenant-api-key")]
    assert key.startswith("sk-kvg-") and len(key) == 50
    (t,) = tenants.tenants
    assert (t.id, t.api_key_sha256) == ("default", [hashlib.sha256(key.encode()).hexdigest()])
    served = {m for u in settings.upstreams for m in u.models}
    assert served and served <= {n for m in settings.models for n in [m.id, *m.aliases]}


def test_redis_urls_per_mode(tmp_path: Path) -> None:
    assert _loaded("minimal", tmp_path)[0].redis_url is None
    assert _loaded("bundled-backend", tmp_path)[0].redis_url == "redis://redis-master.data.svc.cluster.local:6379/0"
    sentinel = _loaded("sentinel", tmp_path)[0].redis_url
    hosts = ",".join(f"redis-sentinel-{i}.redis-sentinel.data.svc.cluster.local:26379" for i in range(3))
    assert sentinel == (
        f"redis+sentinel://:redis-pass-0123456789@{hosts}/kvgate/2?sentinel_password=sentinel-pass-0123456789"
    )
    cluster = _loaded("cluster", tmp_path)[0].redis_url
    hosts = ",".join(f"redis-cluster-{i}.redis-cluster.data.svc.cluster.local:6379" for i in range(3))
    assert cluster == f"rediss+cluster://:redis-pass-0123456789@{hosts}?ssl_ca_certs=/etc/kvgate/redis-tls/ca.crt"
    mounts = {m["name"]: m["mountPath"] for m in gateway_container(render("cluster"))["volumeMounts"]}
    assert mounts["redis-tls"] == "/etc/kvgate/redis-tls"


def test_the_gateway_parses_the_rendered_sentinel_url(tmp_path: Path) -> None:
    from gateway.quotas.tenant_quotas import redis_client_from_url

    client = redis_client_from_url(_loaded("sentinel", tmp_path)[0].redis_url, 0.25)
    pool = client.connection_pool
    assert pool.service_name == "kvgate"
    assert pool.connection_kwargs["password"] == "redis-pass-0123456789"
    assert pool.connection_kwargs["db"] == 2
    sentinels = pool.sentinel_manager.sentinels
    assert [s.connection_pool.connection_kwargs["host"] for s in sentinels] == [
        f"redis-sentinel-{i}.redis-sentinel.data.svc.cluster.local" for i in range(3)
    ]
    assert sentinels[0].connection_pool.connection_kwargs["password"] == "sentinel-pass-0123456789"


def test_upstream_api_keys_come_from_secrets(tmp_path: Path) -> None:
    settings, _, _ = _loaded("cluster", tmp_path)
    keys = {u.name: u.api_key.get_secret_value() for u in settings.upstreams if u.api_key}
    assert keys == {"sglang-a": "sk-engine-0123456789", "sglang-b": "sk-engine-0123456789"}
    assert "upstreams:" not in one(render("cluster"), "ConfigMap")["data"]["kvgate.yaml"].replace("# upstreams", "")


# ---------------------------------------------------------------------------------------- no secret inlined


@pytest.mark.parametrize("example", EXAMPLE_NAMES)
def test_no_secret_value_outside_a_secret(example: str) -> None:
    objs = render(example)
    values = [v for v in secret_data(objs).values() if not v.startswith("tenants:")] + [v for v in EXTERNAL.values()]
    assert len(values) >= 5
    for o in objs:
        if o["kind"] == "Secret":
            continue
        text = yaml.safe_dump(o)
        for v in values:
            assert v not in text and base64.b64encode(v.encode()).decode() not in text, (o["kind"], v[:6])
    for e in env_of(gateway_container(objs)):
        if re.search(r"SECRET|PASSWORD|TOKEN|API_KEY", e["name"]) and e["name"] not in ("KVGATE_UPSTREAMS",):
            assert "secretKeyRef" in e.get("valueFrom", {}), e
        if e["name"] == "KVGATE_REDIS_URL":
            assert "@" not in e["value"] or ":$(REDIS_PASSWORD)@" in e["value"], e


def test_existing_secrets_leave_nothing_generated() -> None:
    sets = [f"secrets.{k}.existingSecret=gw" for k in ("cacheSaltKey", "leakIndexKey", "adminKey")]
    sets += ["metricsToken.existingSecret=metrics", "tenants.existingSecret=tenants"]
    objs = render("minimal", *sets)
    assert [o for o in objs if o["kind"] == "Secret"] == []
    refs = {
        e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in env_of(gateway_container(objs)) if "valueFrom" in e
    }
    assert refs["KVGATE_SECRET_ADMIN_KEY"] == "gw" and refs["KVGATE_GATEWAY__METRICS_TOKEN"] == "metrics"
    vols = {v["name"]: v for v in one(objs, "Deployment")["spec"]["template"]["spec"]["volumes"]}
    assert vols["tenants"]["secret"]["secretName"] == "tenants"


def test_servicemonitor_uses_the_metrics_token_secret() -> None:
    objs = render("sentinel")
    sm = one(objs, "ServiceMonitor")
    (ep,) = sm["spec"]["endpoints"]
    (env,) = [e for e in env_of(gateway_container(objs)) if e["name"] == "KVGATE_GATEWAY__METRICS_TOKEN"]
    assert ep["authorization"] == {"type": "Bearer", "credentials": env["valueFrom"]["secretKeyRef"]}
    assert (ep["port"], ep["path"]) == ("http", "/metrics")
    assert sm["spec"]["selector"]["matchLabels"] == one(objs, "Service")["spec"]["selector"]


# ---------------------------------------------------------------------------------------- the pod


@pytest.mark.parametrize("example", EXAMPLE_NAMES)
def test_probes(example: str) -> None:
    c = gateway_container(render(example))
    for probe, path in (("startupProbe", "/livez"), ("livenessProbe", "/livez"), ("readinessProbe", "/readyz")):
        assert c[probe]["httpGet"] == {"path": path, "port": "http"}, probe
    assert c["ports"][0]["name"] == "http"
    start = c["startupProbe"]
    assert start["periodSeconds"] * start["failureThreshold"] == 120  # tokenizers load, the pool is first read
    # a pod pulled out of the Service (readiness) is not restarted for it (liveness is slower to act)
    ready, live = c["readinessProbe"], c["livenessProbe"]
    assert ready["periodSeconds"] * ready["failureThreshold"] < live["periodSeconds"] * live["failureThreshold"]


def test_probe_paths_are_gateway_routes() -> None:
    """The paths the probes ask for are served by the gateway (the routes every worker has)."""
    from config.models import Settings, TenantsFile
    from config.secrets import SECRET_NAMES
    from gateway.app import create_app
    from gateway.ops.tenants import TenantRegistry

    app = create_app(Settings(), TenantRegistry(TenantsFile()), secrets={n: b"k" * 32 for n in SECRET_NAMES})
    paths = {getattr(r, "path", None) for r in app.router.routes}
    assert {"/livez", "/readyz", "/metrics"} <= paths


@pytest.mark.parametrize("example", EXAMPLE_NAMES)
def test_drain_fits_the_grace_period(example: str, tmp_path: Path) -> None:
    settings, _, _ = _loaded(example, tmp_path)
    spec = one(render(example), "Deployment")["spec"]["template"]["spec"]
    sleep_seconds = spec["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain = math.ceil(settings.gateway.drain_timeout_seconds)
    assert spec["terminationGracePeriodSeconds"] == sleep_seconds + drain + 10


def test_a_grace_period_shorter_than_the_drain_and_its_end_is_refused() -> None:
    """preStop 5 s + drain 30 s, then up to about 1.5 s for ending what is still in flight."""
    assert render("minimal", "drain.terminationGracePeriodSeconds=37")
    for short in (20, 35, 36):
        assert (
            "below preStopSleepSeconds + gateway.drain_timeout_seconds + 2 s for ending the requests still in "
            "flight (37)"
        ) in render_fails("minimal", f"drain.terminationGracePeriodSeconds={short}")


def test_sentinel_drain_timeout_reaches_the_grace_period() -> None:
    spec = one(render("sentinel"), "Deployment")["spec"]["template"]["spec"]
    assert spec["terminationGracePeriodSeconds"] == 5 + 45 + 10


@pytest.mark.parametrize("example", EXAMPLE_NAMES)
def test_security_context(example: str) -> None:
    objs = render(example)
    deployments = [o for o in objs if o["kind"] == "Deployment"]
    assert len(deployments) == (4 if example == "bundled-backend" else 1)
    (test_pod,) = [o for o in objs if o["kind"] == "Pod"]  # `helm test`
    for d in [*deployments, test_pod]:
        spec = d["spec"]["template"]["spec"] if d["kind"] == "Deployment" else d["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] == 10001
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["automountServiceAccountToken"] is False
        emptydirs = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
            assert sc["readOnlyRootFilesystem"] is True and sc["runAsNonRoot"] is True
            assert sc["capabilities"] == {"drop": ["ALL"]}
            writable = {m["name"]: m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")}
            assert set(writable) <= emptydirs, writable  # the only writable paths are emptyDirs
            assert "/tmp" in writable.values()
    c = gateway_container(objs)
    env = {e["name"]: e.get("value") for e in env_of(c)}
    writable = [m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")]
    workers = int(c["args"][c["args"].index("--workers") + 1])
    if workers > 1:
        assert env["PROMETHEUS_MULTIPROC_DIR"] in writable
    else:  # one process: metrics in memory, so a restarted container never sums a dead one's files
        assert "PROMETHEUS_MULTIPROC_DIR" not in env
    assert "/var/lib/kvgate/data" in writable  # state_dir /var/lib/kvgate/data/state is made inside it


# ---------------------------------------------------------------------------------------- scaling


@pytest.mark.parametrize(
    ("cpu", "workers"), [("1", 1), ("250m", 1), ("1000m", 1), ("1500m", 2), ("2", 2), ("2.5", 3), ("3500m", 4)]
)
def test_workers_follow_the_cpu_limit(cpu: str, workers: int) -> None:
    objs = render("bundled-backend", f"resources.limits.cpu={cpu}")
    args = gateway_container(objs)["args"]
    assert args[args.index("--workers") + 1] == str(workers)
    cfg = yaml.safe_load(one(objs, "ConfigMap")["data"]["kvgate.yaml"])
    assert cfg["gateway"]["workers"] == workers
    assert cfg["quotas"]["replicas"] == 2  # replicaCount: what local_fallback divides limits by


def test_workers_override_and_no_cpu_limit() -> None:
    args = gateway_container(render("bundled-backend", "workers=3"))["args"]
    assert args[args.index("--workers") + 1] == "3"
    args = gateway_container(render("bundled-backend", "resources.limits=null"))["args"]
    assert args[args.index("--workers") + 1] == "1"


def test_several_processes_without_redis_are_refused() -> None:
    assert "2 workers per pod need Redis" in render_fails("minimal", "resources.limits.cpu=2")
    assert "more than one gateway pod needs Redis" in render_fails("minimal", "replicaCount=2")
    # with quotas and the verifier off nothing is shared, so several pods are fine
    objs = render("minimal", "replicaCount=2", "config.quotas.enabled=false", "config.verifier.enabled=false")
    assert one(objs, "Deployment")["spec"]["replicas"] == 2


def test_hpa_bounds() -> None:
    for example, lo, hi in (("sentinel", 3, 12), ("cluster", 4, 16)):
        objs = render(example)
        hpa = one(objs, "HorizontalPodAutoscaler")["spec"]
        assert 1 <= hpa["minReplicas"] <= hpa["maxReplicas"]
        assert (hpa["minReplicas"], hpa["maxReplicas"]) == (lo, hi)
        assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": FULLNAME}
        assert "replicas" not in one(objs, "Deployment")["spec"]  # the HPA owns the count
        assert yaml.safe_load(one(objs, "ConfigMap")["data"]["kvgate.yaml"])["quotas"]["replicas"] == hi
    metrics = one(render("sentinel"), "HorizontalPodAutoscaler")["spec"]["metrics"]
    assert metrics[0]["resource"] == {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 65}}
    assert metrics[1]["pods"]["metric"] == {"name": "kvgate_in_flight_requests"}
    assert "minReplicas (13) is above autoscaling.maxReplicas (12)" in render_fails(
        "sentinel", "autoscaling.minReplicas=13"
    )
    assert "minimum" in render_fails("sentinel", "autoscaling.minReplicas=0")


def _disruptions_allowed(pdb: dict[str, Any], pods: int, healthy: int) -> int:
    """What the disruption controller allows: currentHealthy - desiredHealthy, a percentage
    rounded up (Kubernetes docs, "Specifying a Disruption Budget for your Application", from
    pkg/controller/disruption/disruption.go)."""
    spec = pdb["spec"]
    if "minAvailable" in spec:
        desired = int(spec["minAvailable"])
    else:
        mu = spec["maxUnavailable"]
        unavailable = math.ceil(pods * int(mu[:-1]) / 100) if isinstance(mu, str) else int(mu)
        desired = max(0, pods - unavailable)
    return max(0, healthy - desired)


@pytest.mark.parametrize("replicas", [1, 2, 3, 5])
@pytest.mark.parametrize("budget", ["pdb.maxUnavailable=1", "pdb.maxUnavailable=25%", "pdb.minAvailable=1"])
def test_pdb_never_blocks_a_drain(replicas: int, budget: str) -> None:
    if budget == "pdb.minAvailable=1" and replicas == 1:
        assert "pdb.minAvailable (1) is not below the replica count (1)" in render_fails(
            "bundled-backend", "replicaCount=1", budget
        )
        return
    pdb = one(render("bundled-backend", f"replicaCount={replicas}", budget), "PodDisruptionBudget")
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"  # a pod that is not ready never blocks
    assert pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "gateway"
    assert _disruptions_allowed(pdb, replicas, replicas) >= 1  # a drain can always evict one pod
    if replicas > 1:  # and it keeps one serving while it does
        assert replicas - _disruptions_allowed(pdb, replicas, replicas) >= 1


def test_topology_spread() -> None:
    spec = one(render("sentinel"), "Deployment")["spec"]["template"]["spec"]
    labels = one(render("sentinel"), "Deployment")["spec"]["selector"]["matchLabels"]
    keys = [c["topologyKey"] for c in spec["topologySpreadConstraints"]]
    assert keys == ["topology.kubernetes.io/zone", "kubernetes.io/hostname"]
    for c in spec["topologySpreadConstraints"]:
        assert c["labelSelector"]["matchLabels"] == labels
        assert (c["maxSkew"], c["whenUnsatisfiable"], c["matchLabelKeys"]) == (
            1,
            "ScheduleAnyway",
            ["pod-template-hash"],
        )
    spec = one(render("sentinel", "json:topologySpreadConstraints=[]"), "Deployment")["spec"]["template"]["spec"]
    assert "topologySpreadConstraints" not in spec


# ---------------------------------------------------------------------------------------- the rest


def test_bundled_backend_wiring(tmp_path: Path) -> None:
    """Prefill hands its KV to the decode Service (not its own loopback: issue 24's compose fault)."""
    objs = render("bundled-backend")
    args = {
        role: one(objs, "Deployment", f"{FULLNAME}-{role}")["spec"]["template"]["spec"]["containers"][0]["args"]
        for role in ("prefill", "decode", "router")
    }
    assert args["prefill"][args["prefill"].index("--decode-url") + 1] == f"http://{FULLNAME}-decode:30002"
    assert args["router"][args["router"].index("--prefill-url") + 1] == f"http://{FULLNAME}-prefill:30001"
    assert args["router"][args["router"].index("--decode-url") + 1] == f"http://{FULLNAME}-decode:30002"
    for role, port in (("prefill", 30001), ("decode", 30002), ("router", 30000)):
        assert args[role][args[role].index("--port") + 1] == str(port)
        assert one(objs, "Service", f"{FULLNAME}-{role}")["spec"]["ports"][0]["port"] == port
    settings, _, _ = _loaded("bundled-backend", tmp_path)
    (up,) = settings.upstreams
    assert (up.api_url, up.pool_urls) == (
        f"http://{FULLNAME}-router:30000/v1",
        [f"http://{FULLNAME}-prefill:30001/server_info"],
    )
    assert settings.model_by_name("kvgate-tiny").context_length == 8192


def test_network_policy_ports() -> None:
    np = one(render("cluster"), "NetworkPolicy")["spec"]
    assert np["policyTypes"] == ["Ingress", "Egress"]
    assert np["ingress"] == [{"ports": [{"port": "http", "protocol": "TCP"}]}]
    dns, dial = np["egress"]
    assert {p["port"] for p in dns["ports"]} == {53}
    assert [p["port"] for p in dial["ports"]] == [30000, 6379]
    # a restricted ingress still lets Prometheus scrape: the ServiceMonitor uses the same port
    (rule,) = one(render("sentinel"), "NetworkPolicy")["spec"]["ingress"]
    sources = [p["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] for p in rule["from"][:2]]
    assert sources == ["ingress-nginx", "monitoring"]
    test_pod = one(render("sentinel"), "Pod", f"{FULLNAME}-test-ready")["metadata"]["labels"]
    (selector,) = [p["podSelector"]["matchLabels"] for p in rule["from"][2:]]
    assert selector.items() <= test_pod.items()  # `helm test` may reach the gateway
    np = one(render("minimal"), "NetworkPolicy")["spec"]
    assert np["policyTypes"] == ["Ingress"] and "egress" not in np


def test_ingress_and_httproute() -> None:
    ing = one(render("sentinel"), "Ingress")["spec"]
    (rule,) = ing["rules"]
    assert rule["http"]["paths"][0]["backend"] == {"service": {"name": FULLNAME, "port": {"name": "http"}}}
    route = one(render("cluster"), "HTTPRoute")["spec"]
    (rule,) = route["rules"]
    assert rule["backendRefs"] == [{"name": FULLNAME, "port": 8080}]
    assert rule["timeouts"] == {"request": "300s"}
    assert route["parentRefs"][0]["sectionName"] == "https"


# ---------------------------------------------------------------------------------------- the pod, run here


POD_CASES = {
    "one-worker": (),
    # the supervisor and two workers on one port, sharing Redis (db 11: other tests use db 0)
    "two-workers-redis": (
        "resources.limits.cpu=2",
        "redis.mode=standalone",
        'json:redis.hosts=["127.0.0.1:6379"]',
        "redis.db=11",
        "tenants.firstTenant.name=helm-pod-test",
    ),
}


@pytest.mark.parametrize("case", POD_CASES)
def test_the_rendered_pod_serves_and_drains(case: str, tmp_path: Path) -> None:
    """`kvgate serve` run with the rendered args, files and environment (paths moved under a
    temporary folder, loopback instead of 0.0.0.0) in front of a mock SGLang: the startup probe's
    path answers, /readyz turns 200, the generated tenant key and metrics token are accepted, the
    `helm test` script passes, and SIGTERM drains to exit 0 well inside the grace period."""
    from tests.mock_engine import MockEngine

    engine = MockEngine().start()
    try:
        models = [{"id": "m", "context_length": 4096, "tokenizer": {"kind": "bundled"}}]
        ups = [{"name": "mock", "api_url": engine.api_url, "pool_source": "sglang", "pool_urls": [engine.info_url]}]
        ups[0]["models"] = ["m"]
        sets = ("json:config.models=" + json.dumps(models), "json:upstreams=" + json.dumps(ups), *POD_CASES[case])
        objs = render("minimal", *sets)
        spec = one(objs, "Deployment")["spec"]["template"]["spec"]
        args, env, port = _pod_here(objs, tmp_path)
        assert args[args.index("--workers") + 1] == ("2" if case == "two-workers-redis" else "1")
        proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", *args], env=env, cwd=tmp_path)
        try:
            _serves(objs, f"http://127.0.0.1:{port}", proc)
            if case == "two-workers-redis":  # the workers' metrics files are in the emptyDir's place
                assert list((tmp_path / "metrics").glob("*.db"))
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(spec["terminationGracePeriodSeconds"]) == 0
            assert time.monotonic() - t0 < 10  # nothing in flight: the drain ends at once
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
    finally:
        engine.stop()


def _pod_here(objs: list[dict[str, Any]], tmp_path: Path) -> tuple[list[str], dict[str, str], int]:
    """The gateway container's args and environment with its mounts moved under ``tmp_path``
    (ConfigMap and tenants Secret written there; the emptyDirs as folders of mode 0777, as the
    kubelet makes them) and a free loopback port: ``(args, env, port)``."""
    from tests.mock_engine import free_socket

    for folder in ("config", "tenants", "data", "metrics"):
        (tmp_path / folder).mkdir()
    for folder in ("data", "metrics"):
        os.chmod(tmp_path / folder, 0o777)
    (tmp_path / "config" / "kvgate.yaml").write_text(one(objs, "ConfigMap")["data"]["kvgate.yaml"])
    tenants = secret_data(objs)[(f"{FULLNAME}-tenants", "tenants.yaml")]
    (tmp_path / "tenants" / "tenants.yaml").write_text(tenants)
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    args = [a.replace("/etc/kvgate", str(tmp_path)) for a in gateway_container(objs)["args"]]
    args[args.index("--host") + 1] = "127.0.0.1"
    args[args.index("--port") + 1] = str(port)
    env = {k: v.replace("/var/lib/kvgate", str(tmp_path)) for k, v in pod_environment(objs, {}).items()}
    env["KVGATE_STATE_DIR"] = str(tmp_path / "data" / "state")
    return args, {**os.environ, **env}, port


def _serves(objs: list[dict[str, Any]], base: str, proc: subprocess.Popen[bytes]) -> None:
    """The probes' paths, the generated key and metrics token, and `helm test`'s script."""
    c = gateway_container(objs)
    start = c["startupProbe"]
    _wait_200(base + start["httpGet"]["path"], start["periodSeconds"] * start["failureThreshold"], proc, only_200=True)
    _wait_200(base + c["readinessProbe"]["httpGet"]["path"], 20, proc)
    secrets = secret_data(objs)
    key = secrets[(f"{FULLNAME}-secrets", "first-tenant-api-key")]
    r = httpx.get(base + "/v1/models", headers={"authorization": f"Bearer {key}"}, timeout=5)
    assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == ["m"]
    assert httpx.get(base + "/v1/models", headers={"authorization": "Bearer nope"}, timeout=5).status_code == 401
    token = secrets[(f"{FULLNAME}-secrets", "metrics-token")]
    assert httpx.get(base + "/metrics", timeout=5).status_code == 401
    assert httpx.get(base + "/metrics", headers={"authorization": f"Bearer {token}"}, timeout=5).status_code == 200
    test_pod = one(objs, "Pod", f"{FULLNAME}-test-ready")["spec"]["containers"][0]
    script = test_pod["args"][0].replace(f"http://{FULLNAME}:8080", base)
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert (ran.returncode, ran.stdout) == (0, "/livez 200\n/readyz 200\n"), ran.stderr


def _wait_200(url: str, within_seconds: float, proc: subprocess.Popen[bytes], *, only_200: bool = False) -> None:
    """Poll ``url`` until it answers 200. ``only_200``: any other answer fails at once (a
    liveness path answers 200 as soon as the process serves; a 404 is a missing route)."""
    deadline = time.monotonic() + within_seconds
    while True:
        assert proc.poll() is None, f"kvgate serve exited {proc.returncode}"
        try:
            status = httpx.get(url, timeout=2).status_code
            if status == 200:
                return
            assert not only_200, f"{url} answered {status}"
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{url} did not answer 200 within {within_seconds} s"
        time.sleep(0.2)


def test_install_notes_name_the_installed_objects() -> None:
    """`helm install --dry-run=client` (no cluster): the NOTES' commands name the release's own
    Deployment, Service and Secret key, the ones docs/deployment.md's walk-through uses."""
    out = _run_helm(
        "install",
        "kvgate",
        str(CHART),
        "-n",
        "llm",
        "-f",
        str(EXAMPLES[EXAMPLE_NAMES.index("minimal")]),
        "--dry-run=client",
    )
    assert out.returncode == 0, out.stderr
    manifest, notes = out.stdout.split("NOTES:\n")
    objs = [d for d in yaml.safe_load_all(manifest.split("MANIFEST:\n", 1)[1]) if d]
    names = {(o["kind"], o["metadata"]["name"]) for o in objs}
    assert {("Deployment", "kvgate"), ("Service", "kvgate"), ("Secret", "kvgate-secrets")} <= names
    assert "kubectl -n llm rollout status deployment/kvgate" in notes
    assert "kubectl -n llm port-forward service/kvgate 8080:8080" in notes
    assert "get secret kvgate-secrets -o jsonpath='{.data.first-tenant-api-key}'" in notes
    docs = (ROOT / "docs" / "deployment.md").read_text()
    assert "get secret kvgate-secrets -o jsonpath='{.data.first-tenant-api-key}'" in docs
    assert "port-forward service/kvgate 8080:8080" in docs


def test_bundled_backend_model_from_a_volume(schema_cache: Any, tmp_path: Path) -> None:
    """A model folder in a volume: every role mounts it, and the gateway counts prompts with the
    router's own /v1/tokenize (a folder's tokenizer is not kvgate's bundled one)."""
    vols = [{"name": "models", "persistentVolumeClaim": {"claimName": "kvgate-models", "readOnly": True}}]
    mounts = [{"name": "models", "mountPath": "/models", "readOnly": True}]
    objs = render(
        "bundled-backend",
        "backend.model=/models/smollm2-135m-instruct",
        "json:backend.extraVolumes=" + json.dumps(vols),
        "json:backend.extraVolumeMounts=" + json.dumps(mounts),
    )
    for role in ("prefill", "decode", "router"):
        dep = one(objs, "Deployment", f"{FULLNAME}-{role}")
        kubernetes_validate.validate(dep, KUBE_VERSIONS[-1], strict=True)
        spec = dep["spec"]["template"]["spec"]
        (c,) = spec["containers"]
        assert c["args"][c["args"].index("--model") + 1] == "/models/smollm2-135m-instruct"
        assert mounts[0] in c["volumeMounts"] and vols[0] in spec["volumes"]
        env = {e["name"]: e["value"] for e in c["env"]}
        assert env["KVGATE_STATE_DIR"] == "/var/lib/kvgate/data/state"  # inside the pod's writable emptyDir
    config = tmp_path / "kvgate.yaml"
    config.write_text(one(objs, "ConfigMap")["data"]["kvgate.yaml"])
    tok = load_settings(config, environ=pod_environment(objs, {})).model_by_name("kvgate-tiny").tokenizer
    assert (tok.kind, tok.engine_api, tok.url) == ("engine", "sglang", f"http://{FULLNAME}-router:30000")
    assert _loaded("bundled-backend", tmp_path)[0].model_by_name("kvgate-tiny").tokenizer.kind == "bundled"
