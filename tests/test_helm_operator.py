"""The Helm chart as a platform engineer puts it in front of an engine: one test per fault a review
of deploy/helm/kvgate found, each rendering the chart offline (`helm template`) and asserting the
exact values, plus two behaviours of kvgate the chart relies on, run here.

- readiness does not wait for Redis: with Redis down a pod stays in the Service and requests meet
  ``quotas.redis_failure_policy`` (the chart's docs said readiness needed Redis);
- a Sentinel install with egress restricted reaches the master's port, not only the sentinels';
- no preStop hook for ``drain.preStopSleepSeconds: 0`` (a sleep of 0 s is refused before 1.33);
- ``redis.db`` other than 0 with Redis Cluster, and ``config.quotas.replicas`` below the most pods,
  are refused;
- values.schema.json refuses misspelt kvgate.yaml keys (drift-checked against config.models) and
  secrets that would land in the ConfigMap or a plain env value;
- ``tenants.existingSecret`` naming a Secret the chart renders itself is refused (kubectl could
  not create it, and the upgrade would delete the Secret the pods mount);
- every example that counts with a tokenizer folder (``kind: hf``: SGLang's /v1/tokenize takes no
  chats) mounts it read-only;
- pods carry the recommended version and managed-by labels; ``image.digest`` pins an image;
- a tenants file mounted from a Secret (the kubelet swaps a ``..data`` symlink) is reloaded.

Helpers come from tests/test_helm.py (the same release name, examples and helm binary).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from pydantic import BaseModel

from config.models import (
    BackendSettings,
    GatewaySettings,
    ImagePolicy,
    ModelConfig,
    PoolSettings,
    QuotaSettings,
    TenantConfig,
    TokenizerConfig,
    VerifierSettings,
)
from tests.test_helm import (
    CHART,
    EXAMPLES,
    FULLNAME,
    _pod_here,
    _run_helm,
    _wait_200,
    gateway_container,
    one,
    render,
    render_fails,
    secret_data,
)

MOCK_MODELS = [{"id": "m", "context_length": 4096, "tokenizer": {"kind": "bundled"}}]


def _egress_ports(objs: list[dict[str, Any]]) -> list[int]:
    """The TCP ports the gateway may dial besides DNS (the NetworkPolicy's second egress rule)."""
    dns, dial = one(objs, "NetworkPolicy")["spec"]["egress"]
    assert [p["port"] for p in dns["ports"]] == [53, 53]
    return [p["port"] for p in dial["ports"]]


# ---------------------------------------------------------------------------------------- readiness and Redis

QUOTA_503 = {
    "error": {
        "message": "The quota store is unavailable, so the request cannot be admitted. Please try again shortly.",
        "type": "server_error",
        "param": None,
        "code": "quota_backend_unavailable",
    }
}


@pytest.mark.parametrize("policy", ["fail_closed", "local_fallback"])
def test_readiness_does_not_wait_for_redis(policy: str, tmp_path: Path) -> None:
    """`kvgate serve` with the rendered pod's args, files and environment, Redis at a closed port:
    /readyz (the readiness probe's path) answers 200, so the pod stays in the Service, and a chat
    gets the policy's answer: 503 quota_backend_unavailable with Retry-After 1 (fail_closed), or
    the engine's 200 (local_fallback). Were readiness tied to Redis, an outage would empty the
    Service and clients would get the proxy's error instead of either."""
    from tests.mock_engine import MockEngine, free_socket

    sock = free_socket()
    dead_port = sock.getsockname()[1]
    sock.close()
    engine = MockEngine()
    engine.start()
    try:
        ups = [{"name": "mock", "api_url": engine.api_url, "pool_source": "sglang", "pool_urls": [engine.info_url]}]
        ups[0]["models"] = ["m"]
        objs = render(
            "minimal",
            "json:config.models=" + json.dumps(MOCK_MODELS),
            "json:upstreams=" + json.dumps(ups),
            "redis.mode=standalone",
            f'json:redis.hosts=["127.0.0.1:{dead_port}"]',
            f"config.quotas.redis_failure_policy={policy}",
        )
        c = gateway_container(objs)
        assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
        args, env, port = _pod_here(objs, tmp_path)
        assert env["KVGATE_REDIS_URL"] == f"redis://127.0.0.1:{dead_port}/0"
        proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", *args], env=env, cwd=tmp_path)
        try:
            base = f"http://127.0.0.1:{port}"
            _wait_200(base + "/livez", 60, proc, only_200=True)
            _wait_200(base + "/readyz", 20, proc)
            ready = httpx.get(base + "/readyz", timeout=5)
            assert (ready.status_code, ready.json()) == (200, {"status": "ready"})
            key = secret_data(objs)[(f"{FULLNAME}-secrets", "first-tenant-api-key")]
            body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
            r = httpx.post(base + "/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, json=body)
            if policy == "fail_closed":
                assert (r.status_code, r.headers["retry-after"], r.json()) == (503, "1", QUOTA_503)
            else:
                assert (r.status_code, r.json()["choices"][0]["message"]["content"]) == (200, "Hello from the mock.")
            assert httpx.get(base + "/readyz", timeout=5).status_code == 200  # still in the Service
        finally:
            proc.terminate()
            proc.wait(30)
    finally:
        engine.stop()


# ---------------------------------------------------------------------------------------- egress with Sentinel


def test_sentinel_egress_opens_the_master_port() -> None:
    """The sentinels (26379) only name the master; the gateway then dials the master's port (6379
    by default). Before, the egress rule opened 26379 alone, so every quota call timed out."""
    assert _egress_ports(render("sentinel")) == [8000, 26379, 6379]
    assert _egress_ports(render("sentinel", "redis.sentinelMasterPort=6380")) == [8000, 26379, 6380]
    # standalone and cluster dial the hosts' own ports: nothing added
    objs = render("bundled-backend", "networkPolicy.egress.enabled=true")
    assert _egress_ports(objs) == [30000, 30001, 6379]
    assert _egress_ports(render("cluster")) == [30000, 6379]
    assert "minimum: got 0, want 1" in render_fails("sentinel", "redis.sentinelMasterPort=0")


def test_tls_sentinels_follow_redis_tls_unless_told_otherwise(tmp_path: Path) -> None:
    """rediss+sentinel:// speaks TLS to the sentinels too (config/redis_client.py);
    ``redis.tls.sentinels: false`` keeps plaintext sentinels in front of a TLS master."""
    hosts = ",".join(f"redis-sentinel-{i}.redis-sentinel.data.svc.cluster.local:26379" for i in range(3))
    base = f"rediss+sentinel://:$(REDIS_PASSWORD)@{hosts}/kvgate/2?sentinel_password=$(REDIS_SENTINEL_PASSWORD)"
    ca = "ssl_ca_certs=/etc/kvgate/redis-tls/ca.crt"
    tls = ("redis.tls.enabled=true", "redis.tls.caSecret.name=redis-ca")
    assert _redis_url(render("sentinel", *tls)) == f"{base}&{ca}"
    off = _redis_url(render("sentinel", *tls, "redis.tls.sentinels=false"))
    assert off == f"{base}&{ca}&sentinel_ssl=false"
    # without TLS, or outside sentinel mode, the knob adds nothing
    assert "sentinel_ssl" not in _redis_url(render("sentinel", "redis.tls.sentinels=false"))
    assert "sentinel_ssl" not in _redis_url(render("cluster", "redis.tls.sentinels=false"))
    assert "got string, want boolean" in render_fails("sentinel", 'json:redis.tls.sentinels="no"')
    from config.redis_client import parse_redis_url

    assert (
        parse_redis_url(off.replace("$(REDIS_PASSWORD)", "p").replace("$(REDIS_SENTINEL_PASSWORD)", "s")).options[
            "sentinel_ssl"
        ]
        is False
    )


def _redis_url(objs: list[dict[str, Any]]) -> str:
    env = {e["name"]: e.get("value") for e in gateway_container(objs)["env"]}
    return str(env["KVGATE_REDIS_URL"])


# ---------------------------------------------------------------------------------------- shutdown


@pytest.mark.parametrize("kube", ["1.29.0", "1.31.0", "1.37.0"])
def test_no_prestop_hook_for_a_zero_sleep(kube: str) -> None:
    """A preStop ``sleep`` of 0 s is refused by the API server before Kubernetes 1.33
    (PodLifecycleSleepActionAllowZero: alpha, off, in 1.32); 0 now renders no hook at all."""
    objs = render("minimal", "drain.preStopSleepSeconds=0", kube=kube)
    assert "lifecycle" not in gateway_container(objs)
    assert one(objs, "Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 0 + 30 + 10
    hook = gateway_container(render("minimal", "drain.preStopSleepSeconds=1", kube=kube))["lifecycle"]["preStop"]
    assert hook == ({"exec": {"command": ["sleep", "1"]}} if kube == "1.29.0" else {"sleep": {"seconds": 1}})


# ---------------------------------------------------------------------------------------- refused values


def test_cluster_refuses_a_database_other_than_0() -> None:
    """A cluster URL names no database, so ``redis.db: 3`` was dropped and database 0 used."""
    assert "redis.db (3): Redis Cluster has only database 0" in render_fails("cluster", "redis.db=3")
    url = {e["name"]: e.get("value") for e in gateway_container(render("cluster", "redis.db=0"))["env"]}
    assert url["KVGATE_REDIS_URL"].startswith("rediss+cluster://:$(REDIS_PASSWORD)@redis-cluster-0.")
    assert "/0" not in url["KVGATE_REDIS_URL"].split("@", 1)[1]


def test_quotas_replicas_below_the_pod_count_is_refused() -> None:
    """``quotas.replicas`` is what local_fallback divides each limit by (x workers); below the most
    pods there can be, the pods together admit more than the limit during a Redis outage."""
    msg = "config.quotas.replicas (11) is below the most gateway pods there can be (12)"
    assert msg in render_fails("sentinel", "config.quotas.replicas=11")
    msg = "config.quotas.replicas (1) is below the most gateway pods there can be (2)"
    assert msg in render_fails("bundled-backend", "config.quotas.replicas=1")
    for given, rendered in ((None, 12), (12, 12), (24, 24)):  # 24: two releases sharing one Redis
        sets = () if given is None else (f"config.quotas.replicas={given}",)
        cfg = yaml.safe_load(one(render("sentinel", *sets), "ConfigMap")["data"]["kvgate.yaml"])
        assert cfg["quotas"]["replicas"] == rendered
    assert "minimum: got 0, want 1" in render_fails("minimal", "config.quotas.replicas=0")


def test_values_schema_refuses_secrets_outside_secrets() -> None:
    """An engine tokenizer's ``api_key`` would be written into the ConfigMap, a tenant's plain
    ``api_key`` into the values and a Secret kvgate refuses, a password in an extraEnv URL into the
    Deployment: each is refused at install."""
    assert "at '/config/models/0/tokenizer': additional properties 'api_key' not allowed" in render_fails(
        "minimal", "config.models[0].tokenizer.api_key=sk-inline"
    )
    assert "at '/tenants/list/0': additional properties 'api_key' not allowed" in render_fails(
        "minimal", 'json:tenants.list=[{"id": "acme", "api_key": "sk-plain"}]'
    )
    env = [{"name": "KVGATE_REDIS_URL", "value": "redis://:hunter2@redis:6379/0"}]
    assert "at '/extraEnv/0/value': 'not' failed" in render_fails("minimal", "json:extraEnv=" + json.dumps(env))
    for value in ("redis://:$(REDIS_PASSWORD)@redis:6379/0", "http://proxy.internal:3128", "redis://kv@redis:6379"):
        env = [{"name": "SOME_URL", "value": value}]
        assert env[0] in gateway_container(render("minimal", "json:extraEnv=" + json.dumps(env)))["env"]


def test_values_schema_refuses_misspelt_kvgate_keys() -> None:
    """A misspelt kvgate.yaml key used to render, and the new pods then exited at start."""
    cases = {
        "config.gateway.drain_timout_seconds=45": "at '/config/gateway': additional properties 'drain_timout_seconds'",
        "config.pool.headrom=1.2": "at '/config/pool': additional properties 'headrom'",
        "config.quotas.redis_failure_polcy=local_fallback": "at '/config/quotas': additional properties",
        "config.verifier.enabeld=false": "at '/config/verifier': additional properties 'enabeld'",
        "config.models[0].context_lenght=4096": "at '/config/models/0': additional properties 'context_lenght'",
        "config.models[0].tokenizer.engine_ap=vllm": "at '/config/models/0/tokenizer': additional properties",
        "config.models[0].images.max_image=2": "at '/config/models/0/images': additional properties 'max_image'",
        "config.gateway.drain_timeout_seconds=45s": "at '/config/gateway/drain_timeout_seconds': got string,",
    }
    for value, message in cases.items():
        assert message in render_fails("minimal", value), value
    msg = "at '/tenants/list/0': additional properties 'rmp' not allowed"
    assert msg in render_fails("minimal", 'json:tenants.list=[{"id": "acme", "rmp": 5}]')


def _schema_keys(node: dict[str, Any]) -> set[str]:
    assert node["additionalProperties"] is False
    return set(node["properties"])


def test_schema_config_keys_follow_kvgate_settings() -> None:
    """values.schema.json lists each kvgate.yaml section's keys (config/models.py): a key kvgate
    adds or renames fails here until the chart's schema lists it too."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    cfg = schema["properties"]["config"]["properties"]
    sections: dict[str, type[BaseModel]] = {
        "gateway": GatewaySettings,
        "pool": PoolSettings,
        "quotas": QuotaSettings,
        "verifier": VerifierSettings,
        "backend": BackendSettings,
    }
    for name, model in sections.items():
        assert _schema_keys(cfg[name]) == set(model.model_fields), name
    models = cfg["models"]["items"]
    assert _schema_keys(models) == set(ModelConfig.model_fields)
    assert _schema_keys(models["properties"]["tokenizer"]) == set(TokenizerConfig.model_fields) - {"api_key"}
    assert _schema_keys(models["properties"]["images"]) == set(ImagePolicy.model_fields)
    tenant = schema["properties"]["tenants"]["properties"]["list"]["items"]
    assert _schema_keys(tenant) == set(TenantConfig.model_fields)


def _own_secret_refusal(name: str) -> str:
    return (
        f'Error: execution error at (kvgate/templates/configmap.yaml:1:4): tenants.existingSecret "{name}" is a '
        f"Secret this chart renders and Helm owns ({FULLNAME}-tenants: tenants.list and the first tenant; "
        f"{FULLNAME}-secrets: the generated keys): creating it with kubectl fails (AlreadyExists), and naming "
        f"{FULLNAME}-tenants here stops the chart rendering it, so the upgrade deletes the Secret the pods mount. "
        "Put your tenants file in a Secret of another name, e.g. kvgate-my-tenants"
    )


def test_tenants_existing_secret_of_the_charts_own_name_is_refused() -> None:
    """docs/deployment.md used to create ``kvgate-tenants`` with kubectl and upgrade with
    ``tenants.existingSecret=kvgate-tenants``: the chart's own Secret of that name made the create
    fail (AlreadyExists), and the upgrade, no longer rendering it, would have deleted it while the
    Deployment mounted that name."""
    for name in (f"{FULLNAME}-tenants", f"{FULLNAME}-secrets"):
        err = render_fails("minimal", f"tenants.existingSecret={name}")
        assert err.splitlines()[0] == _own_secret_refusal(name)
    objs = render("minimal", "tenants.existingSecret=kvgate-my-tenants")
    volumes = {v["name"]: v for v in one(objs, "Deployment")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tenants"]["secret"]["secretName"] == "kvgate-my-tenants"
    assert [o["metadata"]["name"] for o in objs if o["kind"] == "Secret"] == [f"{FULLNAME}-secrets"]


def test_tokenizer_folders_are_mounted_read_only() -> None:
    """An example counting with the model's tokenizer files (``kind: hf``) mounts the folder from a
    volume of its own, read-only, in the gateway container; none asks SGLang's /v1/tokenize."""
    folders = 0
    for example in EXAMPLES:
        objs = render(example.stem.removeprefix("values-"))
        spec = one(objs, "Deployment")["spec"]["template"]["spec"]
        mounts = gateway_container(objs)["volumeMounts"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        for m in yaml.safe_load(one(objs, "ConfigMap")["data"]["kvgate.yaml"])["models"]:
            tok = m.get("tokenizer", {})
            assert (tok.get("kind"), tok.get("engine_api", "sglang")) != ("engine", "sglang"), (example.name, m["id"])
            if tok.get("kind") != "hf":
                continue
            (mount,) = [x for x in mounts if tok["path"].startswith(x["mountPath"].rstrip("/") + "/")]
            assert mount["readOnly"] is True
            assert volumes[mount["name"]]["persistentVolumeClaim"]["readOnly"] is True
            folders += 1
    assert folders == 2  # values-minimal.yaml and values-cluster.yaml, both in front of SGLang


# ---------------------------------------------------------------------------------------- labels and images


def test_pods_carry_the_recommended_labels() -> None:
    """Pod templates carry app.kubernetes.io/version and managed-by beside the selector labels
    (Kubernetes' recommended labels); the selectors, immutable on upgrade, are unchanged."""
    objs = render("bundled-backend")
    for component in ("gateway", "prefill", "decode", "router"):
        name = FULLNAME if component == "gateway" else f"{FULLNAME}-{component}"
        spec = one(objs, "Deployment", name)["spec"]
        selector = {
            "app.kubernetes.io/name": "kvgate",
            "app.kubernetes.io/instance": "kv",
            "app.kubernetes.io/component": component,
        }
        assert spec["selector"]["matchLabels"] == selector
        labels = {**selector, "app.kubernetes.io/version": "0.1.0", "app.kubernetes.io/managed-by": "Helm"}
        assert spec["template"]["metadata"]["labels"] == labels
    spec = one(render("minimal", 'json:podLabels={"team": "llm"}'), "Deployment")["spec"]["template"]
    assert spec["metadata"]["labels"]["team"] == "llm"


def test_image_digest_pins_every_image() -> None:
    digest = "sha256:" + "ab" * 32
    objs = render("bundled-backend")
    assert gateway_container(objs)["image"] == "kvgate-gateway:0.1.0"
    objs = render("bundled-backend", f"image.digest={digest}", f"backend.image.digest={digest}", "image.tag=0.1.1")
    assert gateway_container(objs)["image"] == f"kvgate-gateway:0.1.1@{digest}"
    assert (
        one(objs, "Pod", f"{FULLNAME}-test-ready")["spec"]["containers"][0]["image"] == f"kvgate-gateway:0.1.1@{digest}"
    )
    decode = one(objs, "Deployment", f"{FULLNAME}-decode")["spec"]["template"]["spec"]["containers"][0]
    assert decode["image"] == f"kvgate-backend:0.1.0@{digest}"
    assert "does not match pattern" in render_fails("minimal", "image.digest=sha256:abc")


# ---------------------------------------------------------------------------------------- tenants reload


def _kubelet_write(folder: Path, files: dict[str, str], stamp: str) -> None:
    """What the kubelet's AtomicWriter does for a Secret or ConfigMap volume: the files go into a
    new timestamped folder, a ``..data_tmp`` symlink to it is renamed over ``..data`` (atomic),
    each file name is a symlink to ``..data/<name>``, and the old folder is removed."""
    new = folder / stamp
    new.mkdir()
    for name, text in files.items():
        (new / name).write_text(text)
    old = os.readlink(folder / "..data") if (folder / "..data").is_symlink() else None
    os.symlink(stamp, folder / "..data_tmp")
    os.replace(folder / "..data_tmp", folder / "..data")
    for name in files:
        if not (folder / name).is_symlink():
            os.symlink(f"..data/{name}", folder / name)
    if old is not None:
        shutil.rmtree(folder / old)


def test_tenants_reload_follows_a_kubelet_secret_update(tmp_path: Path) -> None:
    """The gateway's watcher (gateway/ops/tenant_reload.py) stats the path, which follows the
    symlinks to the new file (new inode), so a Secret update reaches a running pod: one check
    sees the change, the next (the file unchanged since) swaps the table."""
    from gateway.ops.tenant_reload import TenantFileWatcher
    from gateway.ops.tenants import TenantRegistry

    first = secret_data(render("minimal"))
    second = secret_data(render("minimal", "tenants.firstTenant.name=acme"))
    tenants, key = (f"{FULLNAME}-tenants", "tenants.yaml"), (f"{FULLNAME}-secrets", "first-tenant-api-key")
    _kubelet_write(tmp_path, {"tenants.yaml": first[tenants]}, "..2026_01_01_00_00_00.000000001")
    registry = TenantRegistry.from_path(tmp_path / "tenants.yaml")
    watcher = TenantFileWatcher(registry, interval_seconds=3600)
    assert [t.id for t in registry.tenants] == ["default"]
    assert watcher.check() is False  # nothing changed
    _kubelet_write(tmp_path, {"tenants.yaml": second[tenants]}, "..2026_01_01_00_01_00.000000001")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["..2026_01_01_00_01_00.000000001", "..data", "tenants.yaml"]
    assert (watcher.check(), watcher.check()) == (False, True)  # settling, then reloaded
    assert [t.id for t in registry.tenants] == ["acme"]
    new_tenant = registry.lookup(second[key])
    assert new_tenant is not None and new_tenant.id == "acme"
    assert registry.lookup(first[key]) is None  # the old key is revoked
    assert (watcher.reloads, watcher.last_error) == (1, None)


def test_notes_do_not_promise_redis_readiness() -> None:
    """NOTES.txt said a pod waits for Redis to turn ready; it does not (test above)."""
    sentinel = [str(p) for p in EXAMPLES if p.name == "values-sentinel.yaml"]
    out = _run_helm("install", "kvgate", str(CHART), "-n", "llm", "-f", *sentinel, "--dry-run=client")
    assert out.returncode == 0, out.stderr
    notes = out.stdout.split("NOTES:\n", 1)[1]
    assert "1. Wait until the gateway is ready (every upstream's pool read; Redis is not waited for):" in notes
