"""The embedded stack: the bundled backend and the gateway as two child processes on loopback.

Used by ``kvgate up``, ``kvgate demo`` and the tests. :class:`EmbeddedStack` starts

1. the bundled engine, ``python -m gpu_backend --role all`` (docs/design.md backend flags), on the
   configured backend port (30000) or a free one, and waits until its ``/health`` answers 200 and
   its ``/server_info`` carries ``max_total_num_tokens``;
2. the gateway, ``python -m gateway.cli serve --demo`` with a generated ``kvgate.yaml`` whose one
   upstream is that backend (``pool_source: kvgate``), ``redis_url`` from the options (default
   null: quotas in process; with one, ``kvgate serve`` runs a worker per usable core),
   and the tenants file (by default ``config/tenants.yaml``: tenants ``demo-a`` and ``demo-b``
   with the documented demo keys ``sk-demo-a`` / ``sk-demo-b``); it waits for ``/readyz`` 200
   (the live pool limit is known).

The model (:attr:`StackOptions.model`, default the settings' ``backend.model``) is ``tiny-random``
or ``copy-probe`` (the bundled tokenizer, served as ``backend.served_model_name``), a model name
such as ``smollm2-135m-instruct`` (its folder ``<state_dir>/models/NAME``, pulled first with
``python -m gpu_backend model pull NAME`` when it is not there yet, progress on the terminal) or
a Hugging Face folder. For a folder the gateway's model entry is derived from it: id = the
served name (the pull's ``kvgate-model.json``, else the folder's name), tokenizer ``kind: hf``
with the folder as ``path``, context length = min(``backend.context_length``, the folder's
``max_position_embeddings``); the backend gets the same folder, name and context length.

Torch loads only in the backend's process, as in production. Each child runs in a session of
its own (a terminal's Ctrl-C reaches the supervisor only, which then stops the gateway first,
letting it drain, and the backend second) and is told by the kernel to exit if the supervisor
dies (``PR_SET_PDEATHSIG``). :meth:`EmbeddedStack.stop` signals each child's whole process group,
so engine worker processes go too. Children's output goes to ``backend.log`` and
``gateway.log`` in the stack's run directory; start-up errors quote their last lines.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from config.loader import DEFAULT_TENANTS, env_overrides, load_settings, load_tenants, served_tenants
from config.models import ModelConfig, Settings, TokenizerConfig, UpstreamConfig
from config.secrets import private_dir

#: Models built into the bundled backend (the bundled tokenizer; no folder).
BUILTIN_MODELS = ("tiny-random", "copy-probe")
#: What a completed ``kvgate model pull`` writes last into the model's folder.
PULL_MANIFEST = "kvgate-model.json"

#: The documented demo keys of ``config/tenants.yaml`` (``kvgate serve`` accepts them only with ``--demo``).
DEMO_KEYS: dict[str, str] = {"demo-a": "sk-demo-a", "demo-b": "sk-demo-b"}
LOOPBACK = "127.0.0.1"


class StackError(RuntimeError):
    """The embedded stack could not start (a child exited, a port is taken, a health check timed
    out). ``str()`` says which part and quotes the end of its log."""


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free on ``host`` a moment ago (bind to port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_is_free(port: int, host: str = LOOPBACK) -> bool:
    """Whether ``host:port`` can be bound now (``SO_REUSEADDR``, as uvicorn binds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _log_tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log)"
    tail = text.rstrip("\n").splitlines()[-lines:]
    return "\n".join("    " + line for line in tail) or "    (empty log)"


@dataclass
class Child:
    """A child process of the stack: ``name``, the ``Popen``, its log file and base URL."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    url: str

    def alive(self) -> bool:
        """Whether the process is still running."""
        return self.proc.poll() is None

    @classmethod
    def spawn(cls, name: str, cmd: list[str], url: str, options: StackOptions, run_dir: Path) -> Child:
        """Start ``cmd`` as child ``name`` (its own session; output to ``<run_dir>/<name>.log``
        unless ``options.echo_logs``), importing this checkout. Raises :class:`StackError` when
        it cannot be started."""
        log_path = run_dir / f"{name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **options.extra_env}
        if name == "gateway":  # KVGATE_<SECTION>__<KEY> overrides are already in the generated file
            for var in list(env):
                if env_overrides(Settings, {var: env[var]}):
                    del env[var]
        root = str(Path(__file__).resolve().parents[2])  # the checkout, for `-m gateway.cli`
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        if options.echo_logs:
            out: Any = None
        else:
            out = open(log_path, "wb")  # handed to the child, closed below
        try:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT if out else None,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        except OSError as e:
            raise StackError(f"{name}: cannot start {cmd[0]}: {e.strerror or e}") from e
        finally:
            if out is not None:
                out.close()
        return cls(name, proc, log_path, url)

    def died(self, echo_logs: bool) -> StackError:
        """The error for a child that exited during start-up (with its log's tail unless the log
        went to the terminal)."""
        where = "" if echo_logs else f" (log: {self.log_path})\n{_log_tail(self.log_path)}"
        hint = ""
        if self.name == "backend" and "No module named 'torch'" in where:
            hint = "\nThe bundled backend needs PyTorch: pip install 'kvgate[backend]' (or run scripts/bootstrap.sh)."
        return StackError(f"{self.name} exited with status {self.proc.returncode} during start-up{where}{hint}")

    def wait_ready(self, path: str, accept: Any, what: str, timeout_seconds: float, echo_logs: bool) -> Any:
        """GET ``url + path`` every 0.1 s until ``accept(response)`` is not ``None`` and return
        that. Raises :class:`StackError` when the child exits or after ``timeout_seconds``."""
        deadline = time.monotonic() + timeout_seconds
        last = "no answer yet"
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            while True:
                if not self.alive():
                    raise self.died(echo_logs)
                try:
                    r = client.get(self.url + path)
                    ok = accept(r)
                    if ok is not None:
                        return ok
                    last = f"HTTP {r.status_code}: {r.text[:200]}"
                except httpx.HTTPError as e:
                    last = f"{type(e).__name__}"
                if time.monotonic() > deadline:
                    where = "" if echo_logs else f"\n{_log_tail(self.log_path)}"
                    raise StackError(
                        f"{self.name}: {what} not ready after {timeout_seconds:.0f} s ({self.url}{path}: {last}){where}"
                    )
                time.sleep(0.1)

    def stop(self, timeout_seconds: float) -> int | None:
        """SIGTERM the child's process group, wait up to ``timeout_seconds``, then SIGKILL it.
        Returns the exit status (negative: killed by that signal)."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_seconds)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers in the group (engine workers)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        return self.proc.returncode


@dataclass
class StackOptions:
    """How to run the embedded stack.

    ``config``/``tenants``: the settings and tenants files (``None``: the shipped
    ``config/kvgate.yaml`` and ``config/tenants.yaml``, or ``$KVGATE_CONFIG``/``$KVGATE_TENANTS``).
    ``gateway_port``/``backend_port``: ``None`` = the configured port (gateway 8080; backend 30000,
    or a free one if 30000 is taken), ``0`` = a free port. ``backend_args``: extra flags for
    ``python -m gpu_backend``. ``backend_cmd``: replaces the whole backend command (an engine
    of one's own that serves the same routes); ``{host}`` and ``{port}`` in it are filled in.
    ``run_dir``: where the generated config and logs go (``None``: a new temporary directory,
    removed by :meth:`EmbeddedStack.stop`). ``startup_timeout_seconds`` bounds each wait.
    ``echo_logs``: children write to this process's stdout/stderr instead of log files.
    ``drain_timeout_seconds``: how long the gateway may take to exit after SIGTERM (at least the
    settings' ``gateway.drain_timeout_seconds`` + 5 s) before it is killed.
    ``redis_url``: the gateway's ``redis_url`` (``None``: quotas and leak index in its process).
    ``workers``: ``kvgate serve --workers`` (``None``: serve's default, the usable cores with a
    ``redis_url`` and 1 without).
    """

    config: Path | None = None
    tenants: Path | None = None
    host: str = LOOPBACK
    gateway_port: int | None = None
    backend_port: int | None = None
    backend_args: Sequence[str] = ()
    backend_cmd: Sequence[str] | None = None
    run_dir: Path | None = None
    startup_timeout_seconds: float = 180.0
    drain_timeout_seconds: float = 10.0
    echo_logs: bool = False
    extra_env: dict[str, str] = field(default_factory=dict)
    model: str | None = None
    #: the incident's mis-set gate: the upstream's pool is this static number instead of the live one
    static_pool_tokens: int | None = None
    redis_url: str | None = None
    workers: int | None = None


@dataclass(frozen=True)
class ServedModel:
    """What the stack serves: ``backend_model`` (the backend's ``--model``), ``served_name`` (its
    ``--served-model-name`` and the gateway's model id), ``context_length`` and, for a folder,
    ``folder`` (the gateway counts with its tokenizer)."""

    backend_model: str
    served_name: str
    context_length: int
    folder: Path | None = None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def pull_model(name: str, state_dir: str | os.PathLike[str], echo: bool = True) -> Path:
    """``python -m gpu_backend model pull NAME`` in a process of its own (progress on this
    terminal's stderr unless ``echo`` is false); returns the folder. Raises :class:`StackError`
    when the pull fails (its last output quoted)."""
    cmd = [sys.executable, "-m", "gpu_backend", "model", "--state-dir", str(state_dir), "pull", name]
    env = {**os.environ}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    r = subprocess.run(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=sys.stderr if echo else subprocess.PIPE,
        stderr=None if echo else subprocess.STDOUT,
        env=env,
        check=False,
    )
    if r.returncode != 0:
        said = "" if echo else "\n" + (r.stdout or b"").decode("utf-8", "replace")[-2000:]
        raise StackError(
            f"model '{name}' is not available: kvgate model pull {name} failed (exit {r.returncode}){said}"
        )
    return Path(state_dir) / "models" / name


def resolve_served_model(base: Settings, model: str | None, echo: bool = True) -> ServedModel:
    """The model the stack serves (see the module doc). Raises :class:`StackError` for a pull that
    fails or a folder without ``config.json`` / ``tokenizer.json``."""
    b = base.backend
    spec = model or b.model
    if spec in BUILTIN_MODELS:
        return ServedModel(spec, b.served_model_name, b.context_length)
    folder = Path(spec)
    if not folder.is_dir():
        pulled = Path(base.state_dir) / "models" / spec
        if "/" in spec or os.sep in spec:
            raise StackError(f"model folder {spec} does not exist")
        folder = pulled if (pulled / PULL_MANIFEST).is_file() else pull_model(spec, base.state_dir, echo)
    folder = folder.resolve()
    for need in ("config.json", "tokenizer.json"):
        if not (folder / need).is_file():
            raise StackError(f"model folder {folder} has no {need}")
    manifest = _read_json(folder / PULL_MANIFEST)
    name = manifest.get("served_model_name") if isinstance(manifest.get("served_model_name"), str) else None
    ctx = _read_json(folder / "config.json").get("max_position_embeddings")
    context = min(b.context_length, ctx) if isinstance(ctx, int) and ctx > 0 else b.context_length
    return ServedModel(str(folder), name or folder.name, context, folder)


# ---------------------------------------------------------------- what the stack runs
def pick_backend_port(options: StackOptions, base: Settings) -> int:
    """The backend's port: the option, else the configured one when free, else a free one."""
    p = options.backend_port
    if p is None:
        p = base.backend.port if port_is_free(base.backend.port, options.host) else 0
    return p or free_port(options.host)


def pick_gateway_port(options: StackOptions, base: Settings) -> int:
    """The gateway's port: the option, else the configured one (0: a free one). Raises
    :class:`StackError` when that port is in use."""
    p = options.gateway_port
    if p is None:
        p = base.gateway.port
    if p and not port_is_free(p, options.host):
        raise StackError(
            f"gateway port {p} on {options.host} is in use (pick another with --port, or --port 0 for a free one)"
        )
    return p or free_port(options.host)


def gateway_cmd(options: StackOptions, config_path: Path, tenants_path: Path, host: str, port: int) -> list[str]:
    """``kvgate serve`` on the generated config, in demo mode, with ``--tenants-for-served-models``
    (one tenants file serves every ``--model``: a tenant allowed only models this stack does not
    serve is left out, never widened, on every load and reload of the file)."""
    return [
        sys.executable,
        "-m",
        "gateway.cli",
        "serve",
        "--config",
        str(config_path),
        "--tenants",
        str(tenants_path),
        "--host",
        host,
        "--port",
        str(port),
        "--demo",
        "--tenants-for-served-models",
    ] + (["--workers", str(options.workers)] if options.workers is not None else [])


def tenant_models(tenants_path: Path) -> list[str]:
    """Model names the tenants file lets some tenant use (kept in the gateway's settings even
    when the stack serves another model, so the file still loads)."""
    try:
        return [n for t in load_tenants(tenants_path).tenants for n in t.allowed_models]
    except Exception:  # the gateway reports a bad tenants file itself, with its path
        return []


def tenant_notes(settings: Settings, tenants_path: Path) -> list[str]:
    """One line per tenant of the file that the gateway on ``settings`` leaves out (or narrows)
    because it is allowed only models those settings do not serve (``config.loader.served_tenants``);
    ``[]`` for a file that does not load (the gateway reports it itself)."""
    try:
        return served_tenants(settings, load_tenants(tenants_path))[1]
    except Exception:
        return []


class EmbeddedStack:
    """The bundled backend and the gateway, started and stopped together.

    Use as a context manager (``with EmbeddedStack(opts) as stack: ...``) or call :meth:`start`
    and :meth:`stop`. After start: :attr:`gateway_url` (``http://host:port``, OpenAI base is
    ``gateway_url + "/v1"``), :attr:`backend_url`, :attr:`server_info` (the backend's
    ``/server_info`` dict), :attr:`settings` (the gateway's effective settings), :attr:`model`
    (the served model id) and :attr:`keys` (tenant id -> demo key). Raises :class:`StackError`.
    """

    def __init__(self, options: StackOptions | None = None) -> None:
        self.options = options or StackOptions()
        self.backend: Child | None = None
        self.gateway: Child | None = None
        self.server_info: dict[str, Any] = {}
        self.settings: Settings | None = None
        self.keys: dict[str, str] = dict(DEMO_KEYS)
        self._own_run_dir = self.options.run_dir is None
        self.run_dir = Path(self.options.run_dir or tempfile.mkdtemp(prefix="kvgate-stack-"))
        private_dir(self.run_dir)  # under the state directory: 0700 when kvgate creates it
        self.tenants_path = Path(self.options.tenants or os.environ.get("KVGATE_TENANTS") or DEFAULT_TENANTS)
        self.config_path = self.run_dir / "kvgate.yaml"
        self.served: ServedModel | None = None

    # ------------------------------------------------------------ properties
    @property
    def gateway_url(self) -> str:
        """``http://host:port`` of the gateway."""
        assert self.gateway is not None, "stack not started"
        return self.gateway.url

    @property
    def backend_url(self) -> str:
        """``http://host:port`` of the bundled backend's router."""
        assert self.backend is not None, "stack not started"
        return self.backend.url

    @property
    def model(self) -> str:
        """The model id the gateway serves (the backend's served model name)."""
        assert self.served is not None, "stack not started"
        return self.served.served_name

    # ------------------------------------------------------------ lifecycle
    def __enter__(self) -> EmbeddedStack:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self, announce: Callable[[], None] | None = None) -> EmbeddedStack:
        """Start the backend, wait for it, start the gateway, wait for ``/readyz``. On any
        failure both children are stopped and :class:`StackError` is raised. ``announce``: called
        once the ports and the model are settled, just before the backend is spawned (a taken
        port or an unknown model is refused before anything says the stack is starting)."""
        try:
            base = load_settings(self.options.config, environ={**os.environ, **self.options.extra_env})
            host = self.options.host
            backend_port = pick_backend_port(self.options, base)
            gateway_port = pick_gateway_port(self.options, base)
            self.served = resolve_served_model(base, self.options.model, echo=True)
            if announce is not None:
                announce()
            self.backend = Child.spawn(
                "backend",
                self._backend_cmd(base, host, backend_port),
                f"http://{host}:{backend_port}",
                self.options,
                self.run_dir,
            )
            self.server_info = self._wait_backend()
            self.settings = self._gateway_settings(base, host, backend_port, gateway_port)
            self.config_path.write_text(yaml.safe_dump(self.settings.model_dump(mode="json"), sort_keys=False))
            for note in tenant_notes(self.settings, self.tenants_path):
                print(f"kvgate: {self.tenants_path}: {note}", file=sys.stderr, flush=True)
            self.gateway = Child.spawn(
                "gateway",
                gateway_cmd(self.options, self.config_path, self.tenants_path, host, gateway_port),
                f"http://{host}:{gateway_port}",
                self.options,
                self.run_dir,
            )
            self._wait_gateway()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop the gateway (SIGTERM: it drains) and then the backend; idempotent. Removes the
        run directory when the stack made it."""
        if self.gateway is not None:
            drain = self.settings.gateway.drain_timeout_seconds if self.settings is not None else 0.0
            self.gateway.stop(max(self.options.drain_timeout_seconds, drain + 5.0))
        if self.backend is not None:
            self.backend.stop(10.0)
        if self._own_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def reload_tenants(self) -> None:
        """Ask the gateway to re-read its tenants file (SIGHUP, as ``kvgate serve`` handles it).
        Raises :class:`StackError` when the gateway is not running."""
        if self.gateway is None or not self.gateway.alive():
            raise StackError("the gateway is not running")
        os.kill(self.gateway.proc.pid, signal.SIGHUP)

    def check_alive(self) -> None:
        """Raise :class:`StackError` when a child has exited (with the end of its log)."""
        for child in (self.backend, self.gateway):
            if child is not None and not child.alive():
                raise child.died(self.options.echo_logs)

    # ------------------------------------------------------------ pieces
    def _backend_cmd(self, base: Settings, host: str, port: int) -> list[str]:
        if self.options.backend_cmd:
            return [a.replace("{host}", host).replace("{port}", str(port)) for a in self.options.backend_cmd]
        b = base.backend
        served = self.served or resolve_served_model(base, self.options.model)
        flags: list[tuple[str, object]] = [
            ("--role", "all"),
            ("--host", host),
            ("--port", port),
            ("--model", served.backend_model),
            ("--served-model-name", served.served_name),
            ("--device", b.device),
            ("--context-length", served.context_length),
            ("--page-size", b.page_size),
            ("--prefill-max-total-tokens", b.prefill_max_total_tokens),
            ("--decode-max-total-tokens", b.decode_max_total_tokens),
            ("--seed", b.seed),
            ("--max-total-tokens", b.max_total_tokens),
            ("--mem-budget-bytes", b.mem_budget_bytes),
        ]
        extra = list(self.options.backend_args)
        given = {a.split("=", 1)[0] for a in extra if a.startswith("--")}
        cmd = [sys.executable, "-m", "gpu_backend"]
        for flag, value in flags:  # a flag of backend_args replaces the settings' one: each flag once
            if value is not None and flag not in given:
                cmd += [flag, str(value)]
        return cmd + extra

    def _gateway_settings(self, base: Settings, host: str, backend_port: int, gateway_port: int) -> Settings:
        """The gateway's settings: ``base`` with one upstream (this backend), the bind address,
        ``redis_url`` from the options (default null: in-process quotas) and ``state_dir`` kept."""
        data = base.model_dump(mode="json", exclude={"upstreams", "models"})
        sm = self.served or resolve_served_model(base, self.options.model)
        served = sm.served_name
        keep: set[str] | None = None  # serving a folder: only the models a tenant names stay beside it
        if sm.folder is not None:
            keep = {m.id for n in tenant_models(self.tenants_path) if (m := base.model_by_name(n)) is not None}
        models = [
            m.model_dump(mode="json")
            for m in base.models
            if keep is None or (m.id in keep and served not in (m.id, *m.aliases))
        ]
        if sm.folder is not None:  # the folder's own tokenizer, chat template and context length
            tok = TokenizerConfig(kind="hf", path=str(sm.folder))
            models.append(
                ModelConfig(id=served, context_length=sm.context_length, tokenizer=tok).model_dump(mode="json")
            )
        elif base.model_by_name(served) is None:
            models.append(ModelConfig(id=served, context_length=sm.context_length).model_dump(mode="json"))
        backend = f"http://{host}:{backend_port}"
        if self.options.static_pool_tokens:  # kvgate demo --incident: the gate mis-set on purpose
            upstream = UpstreamConfig(
                name="embedded",
                api_url=f"{backend}/v1",
                pool_source="static",
                engine="kvgate",  # the bundled engine's field policy (static's default would be openai)
                static_pool_tokens=self.options.static_pool_tokens,
                models=[served],
            )
        else:
            upstream = UpstreamConfig(
                name="embedded",
                api_url=f"{backend}/v1",
                pool_source="kvgate",
                engine="kvgate",  # the bundled engine's field policy, written out
                pool_urls=[f"{backend}/server_info"],
                models=[served],
            )
        data.update(models=models, upstreams=[upstream.model_dump(mode="json")], redis_url=self.options.redis_url)
        data["gateway"].update(host=host, port=gateway_port)
        data["state_dir"] = str(Path(base.state_dir).resolve())
        return Settings.model_validate(data)

    def _ready(self, child: Child, path: str, accept: Any, what: str) -> Any:
        o = self.options
        return child.wait_ready(path, accept, what, o.startup_timeout_seconds, o.echo_logs)

    def _wait_backend(self) -> dict[str, Any]:
        assert self.backend is not None
        self._ready(self.backend, "/health", lambda r: True if r.status_code == 200 else None, "/health")

        def info(r: httpx.Response) -> dict[str, Any] | None:
            if r.status_code != 200:
                return None
            body = r.json()
            return body if isinstance(body, dict) and isinstance(body.get("max_total_num_tokens"), int) else None

        return self._ready(self.backend, "/server_info", info, "/server_info (max_total_num_tokens)")

    def _wait_gateway(self) -> None:
        assert self.gateway is not None
        self._ready(self.gateway, "/readyz", lambda r: True if r.status_code == 200 else None, "/readyz")


# ---------------------------------------------------------------- supervising from a CLI command
@contextlib.contextmanager
def terminate_as_interrupt() -> Any:
    """While active, SIGTERM and SIGINT raise ``KeyboardInterrupt`` in the main thread, so a
    supervisor stopped by either runs its ``finally`` blocks and stops its children. SIGINT is
    handled even when the parent left it ignored (a background job of a non-interactive shell)."""

    def _raise(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    old_term = signal.signal(signal.SIGTERM, _raise)
    old_int = signal.signal(signal.SIGINT, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)


def serve_until_interrupted(stack: EmbeddedStack, *, poll_seconds: float = 0.5) -> int:
    """Block while the stack serves. Returns 0 on Ctrl-C/SIGTERM (inside
    :func:`terminate_as_interrupt`), 1 when a child exits on its own (its log tail is printed to
    stderr). SIGHUP meanwhile makes the gateway re-read its tenants file."""

    def _reload(_signum: int, _frame: Any) -> None:
        if stack.gateway is not None and stack.gateway.alive():  # a dead one is reported by the loop
            with contextlib.suppress(ProcessLookupError):
                stack.reload_tenants()

    old_hup = signal.signal(signal.SIGHUP, _reload)
    try:
        while True:
            time.sleep(poll_seconds)
            stack.check_alive()
    except KeyboardInterrupt:
        return 0
    except StackError as e:
        print(f"kvgate: {e}".replace("during start-up", "while serving"), file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGHUP, old_hup)
