"""docker-compose.smollm2.yml (SmolLM2 on top of docker-compose.yml), checked with
``docker-compose config`` (no Docker engine needed): one pull into the ``models`` volume, which
every node, the router and the gateway mount read-only once the pull has completed."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import yaml

from tests.conftest import ROOT

FOLDER = "/var/lib/kvgate/models-state/models/smollm2-135m-instruct"


@pytest.fixture(scope="module")
def merged() -> dict:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose is not installed (scripts/test.sh installs it)")
    r = subprocess.run(
        [exe, "-f", "docker-compose.yml", "-f", "docker-compose.smollm2.yml", "config"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    return yaml.safe_load(r.stdout)["services"]


def test_one_pull_into_the_models_volume(merged):
    pull = merged["model-pull"]
    assert pull["entrypoint"] == ["kvgate", "model"]
    assert pull["command"] == ["--state-dir", "/var/lib/kvgate/models-state", "pull", "smollm2-135m-instruct"]
    assert pull["restart"] == "no"


@pytest.mark.parametrize("name", ["prefill", "decode", "prefill-gpu", "decode-gpu", "router"])
def test_backend_services_serve_the_pulled_folder(merged, name):
    s = merged[name]
    cmd = s["command"]
    assert cmd[cmd.index("--model") + 1] == FOLDER
    assert cmd[cmd.index("--served-model-name") + 1] == "smollm2-135m-instruct"
    mounts = [
        v if isinstance(v, str) else f"{v['source']}:{v['target']}:{'ro' if v.get('read_only') else 'rw'}"
        for v in s["volumes"]
    ]
    assert mounts == ["models:/var/lib/kvgate/models-state:ro"]
    assert s["depends_on"]["model-pull"]["condition"] == "service_completed_successfully"


@pytest.mark.parametrize("name", ["gateway", "gateway-demo"])
def test_gateways_count_with_the_folders_tokenizer(merged, name):
    env = merged[name]["environment"]
    models = json.loads(env["KVGATE_MODELS"])
    assert models == [
        {"id": "smollm2-135m-instruct", "context_length": 8192, "tokenizer": {"kind": "hf", "path": FOLDER}}
    ]
    assert json.loads(env["KVGATE_UPSTREAMS"])[0]["models"] == ["smollm2-135m-instruct"]
    targets = [v if isinstance(v, str) else v["target"] for v in merged[name]["volumes"]]
    assert any("models-state" in t for t in targets)
