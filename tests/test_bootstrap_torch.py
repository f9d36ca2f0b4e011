"""scripts/torch_choice.sh (what scripts/bootstrap.sh installs as torch), run by bash against
stand-in indexes (file:// folders holding tiny fake torch wheels) with pip's own ``--dry-run``:
a configured local CPU wheel is taken; with none, the CPU wheel index; where that cannot be
reached, it stops with a message saying how to choose; the CUDA build only when asked."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(120)


def fake_torch(folder: Path, version: str, requires: tuple[str, ...] = ()) -> None:
    """A wheel of a ``torch`` package at ``version`` in ``folder/torch/``, listed in its
    ``index.html`` (a simple index pip reads over file://)."""
    (folder / "torch").mkdir(parents=True, exist_ok=True)
    info = f"torch-{version}.dist-info"
    meta = f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires
    )
    with zipfile.ZipFile(folder / "torch" / f"torch-{version}-py3-none-any.whl", "w") as z:
        z.writestr("torch/__init__.py", "")
        z.writestr(f"{info}/METADATA", meta)
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    links = "".join(f'<a href="{w.name}">{w.name}</a>' for w in sorted((folder / "torch").glob("*.whl")))
    (folder / "torch" / "index.html").write_text(f"<html><body>{links}</body></html>")


@pytest.fixture(scope="module")
def indexes(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("indexes")
    fake_torch(root / "pypi", "2.13.0", ("nvidia-cublas-cu12",))  # what PyPI serves on Linux: the CUDA build
    fake_torch(root / "cpu", "2.13.0+cpu")  # PyTorch's CPU wheel index
    fake_torch(root / "local", "2.13.0+cpu")  # a wheel on disk, configured with find-links
    with socket.socket() as s:  # a port nothing listens on: an index that cannot be reached
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}/simple"
    return {k: (root / k).as_uri() for k in ("pypi", "cpu")} | {
        "local": str(root / "local" / "torch"),
        "closed": closed,
    }


def choose(indexes: dict[str, str], **env: str) -> tuple[int, str, str, str]:
    """(exit code, stdout, stderr, TORCH_PIP_ARGS) of ``choose_torch`` with pip's configuration
    replaced by ``PIP_*`` variables only."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "KVGATE_TORCH"))}
    base |= {"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": indexes["pypi"], "PIP_NO_CACHE_DIR": "1"} | env
    script = f'. {ROOT}/scripts/torch_choice.sh; choose_torch {sys.executable} || exit $?; echo "ARGS ${{TORCH_PIP_ARGS[*]}}"'
    r = subprocess.run(["bash", "-c", script], env=base, capture_output=True, text=True, timeout=100)
    out, _, args = r.stdout.partition("ARGS ")
    return r.returncode, out.strip(), r.stderr.strip(), args.strip()


def test_a_configured_local_cpu_wheel_is_taken(indexes):
    rc, out, err, args = choose(indexes, PIP_FIND_LINKS=indexes["local"], KVGATE_TORCH_CPU_INDEX=indexes["closed"])
    assert (rc, err, args) == (0, "", "torch==2.13.0+cpu")
    assert out == "kvgate: torch 2.13.0+cpu: the CPU build that pip's configuration offers (a local wheel or index)"


def test_without_one_the_cpu_wheel_index_is_asked(indexes):
    rc, out, err, args = choose(indexes, KVGATE_TORCH_CPU_INDEX=indexes["cpu"])
    assert (rc, err, args) == (0, "", f"--index-url {indexes['cpu']} torch==2.13.0+cpu")
    assert out == (
        f"kvgate: torch 2.13.0+cpu: the CPU build from PyTorch's CPU wheel index ({indexes['cpu']}); "
        "pip's configuration offers 2.13.0, not a CPU build"
    )


def test_an_unreachable_cpu_index_stops_with_how_to_choose_never_the_cuda_build(indexes):
    rc, out, err, args = choose(indexes, KVGATE_TORCH_CPU_INDEX=indexes["closed"])
    assert (rc, out, args) == (1, "", "")
    assert err == (
        "kvgate: no CPU build of torch==2.13.0 found: pip's configuration offers 2.13.0 (not a CPU build, so "
        f"not taken) and {indexes['closed']} could not be reached or holds none. Choose one: "
        "KVGATE_TORCH_INDEX_URL=<an index with the CPU build> (a mirror of the CPU wheel index), or "
        "KVGATE_TORCH=cuda for the CUDA build (several GB of nvidia-* wheels)."
    )


def test_the_cuda_build_only_when_asked_and_a_named_index_as_named(indexes):
    rc, out, _, args = choose(indexes, KVGATE_TORCH="cuda", KVGATE_TORCH_CPU_INDEX=indexes["closed"])
    assert (rc, args) == (0, "torch==2.13.0")
    assert out == "kvgate: torch 2.13.0: the CUDA build from pip's configured index (asked with KVGATE_TORCH=cuda)"
    rc, out, _, args = choose(indexes, KVGATE_TORCH_INDEX_URL=indexes["cpu"])
    assert (rc, args) == (0, f"--index-url {indexes['cpu']} torch==2.13.0+cpu")
    assert out == f"kvgate: torch 2.13.0+cpu from KVGATE_TORCH_INDEX_URL ({indexes['cpu']}), as asked"
    rc, _, err, _ = choose(indexes, KVGATE_TORCH="rocm")
    assert (rc, err) == (1, "kvgate: KVGATE_TORCH must be 'cpu' or 'cuda' (got 'rocm')")
