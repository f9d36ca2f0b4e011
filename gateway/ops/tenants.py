"""Tenants and their API keys (docs/design.md, "Tenant entry").

Keys are stored only as lowercase hex SHA-256 hashes. :class:`TenantRegistry` maps a presented
key to its tenant; :meth:`TenantRegistry.reload` re-reads ``tenants.yaml`` and swaps the whole
table in one assignment, so a request sees either the old table or the new one, never a mix.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from config.loader import ConfigError, check_tenant_models, load_tenants, served_tenants, validate_yaml_text
from config.models import Settings, TenantConfig, TenantsFile

log = logging.getLogger("kvgate.tenants")


#: what identifies one version of the tenants file: ``(st_mtime_ns, st_size, st_ino)``
Signature = tuple[int, int, int]


def file_signature(path: str | os.PathLike[str] | int) -> Signature | None:
    """``(mtime in ns, size in bytes, inode)`` of ``path`` (symlinks followed) or of an open file
    descriptor; ``None`` when it cannot be read (missing, no permission)."""
    try:
        st = os.fstat(path) if isinstance(path, int) else os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def hash_key(api_key: str) -> str:
    """Lowercase hex SHA-256 of an API key (the form ``tenants.yaml`` stores)."""
    return hashlib.sha256(api_key.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True)
class _Table:
    by_hash: dict[str, TenantConfig]
    by_id: dict[str, TenantConfig]
    tenants: tuple[TenantConfig, ...]


def _build(tenants: TenantsFile) -> _Table:
    by_hash: dict[str, TenantConfig] = {}
    by_id: dict[str, TenantConfig] = {}
    for t in tenants.tenants:
        by_id[t.id] = t
        for h in t.api_key_sha256:
            by_hash[h] = t
    return _Table(by_hash, by_id, tuple(tenants.tenants))


class TenantRegistry:
    """The tenant table of one gateway process.

    ``lookup(key)`` hashes the key and finds the tenant; the match is confirmed with
    ``hmac.compare_digest`` on the full hash (a dict probe on a SHA-256 digest reveals nothing
    usable about the key itself). ``path``: the ``tenants.yaml`` that :meth:`reload` reads.
    ``settings``: when given, every load (and reload) also checks that each tenant's
    ``allowed_models`` names a configured model (``config.loader.check_tenant_models``).
    ``served_only`` (with ``settings``; ``kvgate serve --tenants-for-served-models``): instead of
    refusing such a file, every load leaves out the tenants allowed none of the configured models
    and drops unknown entries from the others (``config.loader.served_tenants``), logging a
    warning per tenant; :attr:`notes` holds those lines of the last load. A reload does the same
    whatever ``served_only`` says (module :mod:`gateway.ops.tenant_reload`). ``refused_key_hashes``:
    hashes no table may accept (``kvgate serve`` without ``--demo``: the documented demo keys'),
    checked on every reload (the start checks them itself, with its own message). ``signature``:
    :func:`file_signature` of the file as it was before the table in force was read from it
    (``None`` when not read from :attr:`path`), where a watcher starts (an edit made while the
    gateway started is then reloaded, not taken for the file already read).
    """

    def __init__(
        self,
        tenants: TenantsFile,
        path: str | os.PathLike[str] | None = None,
        settings: Settings | None = None,
        *,
        served_only: bool = False,
    ) -> None:
        self.path = Path(path) if path is not None else None
        self.settings = settings
        self.served_only = served_only
        self.notes: list[str] = []
        self.refused_key_hashes: frozenset[str] = frozenset()
        self._table = _build(self._check(tenants))
        self.version = 1
        self.signature: Signature | None = None

    def _check(self, tenants: TenantsFile, *, reloading: bool = False) -> TenantsFile:
        if self.settings is None:
            return tenants
        if not (self.served_only or reloading):
            check_tenant_models(self.settings, tenants, self.path or "tenants")
            return tenants
        tenants, self.notes = served_tenants(self.settings, tenants)
        for note in self.notes:
            log.warning("%s: %s", self.path or "tenants", note)
        return tenants

    @classmethod
    def from_path(
        cls,
        path: str | os.PathLike[str] | None = None,
        settings: Settings | None = None,
        *,
        served_only: bool = False,
    ) -> TenantRegistry:
        """Load ``tenants.yaml`` (``config.loader.load_tenants`` rules). Raises ``ConfigError``,
        also for an ``allowed_models`` entry unknown to ``settings`` when given (unless
        ``served_only``: see the class)."""
        if path is None:
            from config.loader import DEFAULT_TENANTS

            path = os.environ.get("KVGATE_TENANTS") or DEFAULT_TENANTS
        p = Path(path)
        signature = file_signature(p)  # before the read: an edit during it is a change still to load
        registry = cls(load_tenants(p), p, settings, served_only=served_only)
        registry.signature = signature
        return registry

    def reload(self, tenants: TenantsFile | None = None, *, expect: Signature | None = None) -> None:
        """Swap in a new table: ``tenants`` when given, else re-read :attr:`path` (once). An
        ``allowed_models`` entry the settings do not know is dropped from its tenant (the tenant
        left out when none is left, never widened), with a warning, where a start refuses the
        file: refusing the whole table kept every earlier tenant, a revoked key included, valid
        until someone read the log. Raises ``ConfigError`` (the old table stays) when the file is
        invalid, holds no ``tenants`` list (a file being written in place reads empty, or as its
        first comment lines, for a moment: an empty table is ``tenants: []``), changed while it
        was read or since its :func:`file_signature` was ``expect`` (a half-written file, read
        again once it stays the same), or accepts a key of :attr:`refused_key_hashes`; ``OSError``
        when it cannot be read."""
        source = str(self.path or "tenants")
        signature = self.signature
        if tenants is None:
            tenants, signature = self._read(expect)
        checked = self._check(tenants, reloading=True)
        refused = [t.id for t in checked.tenants if self.refused_key_hashes.intersection(t.api_key_sha256)]
        if refused:
            raise ConfigError(
                source,
                [
                    f"tenant(s) {', '.join(refused)} accept a documented demo key (sk-demo-a/sk-demo-b), "
                    "and this gateway was started without --demo"
                ],
            )
        self._table = _build(checked)  # one reference assignment: atomic for readers
        self.signature = signature
        self.version += 1

    def _read(self, expect: Signature | None) -> tuple[TenantsFile, Signature | None]:
        """:attr:`path` read once and validated, with its :func:`file_signature` before the read
        (see :meth:`reload`). Reading it twice (is it empty? then parse it) let a write between
        the two reads make an empty table, every key a 401."""
        if self.path is None:
            raise ValueError("this registry has no tenants file to reload")
        source = str(self.path)
        with open(self.path, "rb") as f:
            before = file_signature(f.fileno())
            data = f.read()
        if before != file_signature(self.path) or (expect is not None and before != expect):
            raise ConfigError(
                source, ["the file changed while it was read (being written?); read again once it stays the same"]
            )
        if not data.strip():
            raise ConfigError(source, ["the file is empty (being written?); an empty table is 'tenants: []'"])
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(source, [f"not UTF-8 text: {e.reason} at byte {e.start}"]) from None
        tenants = validate_yaml_text(text, TenantsFile, self.path)
        if "tenants" not in tenants.model_fields_set:
            raise ConfigError(source, ["no 'tenants' list (being written?); an empty table is 'tenants: []'"])
        return tenants, before

    def lookup(self, api_key: str) -> TenantConfig | None:
        """The tenant whose hash list holds ``sha256(api_key)``, else ``None``."""
        digest = hash_key(api_key)
        table = self._table
        tenant = table.by_hash.get(digest)
        if tenant is None:
            return None
        for h in tenant.api_key_sha256:
            if hmac.compare_digest(h, digest):
                return tenant
        return None

    def get(self, tenant_id: str) -> TenantConfig | None:
        """The tenant with this id, else ``None``."""
        return self._table.by_id.get(tenant_id)

    @property
    def tenants(self) -> tuple[TenantConfig, ...]:
        """Every tenant, in file order."""
        return self._table.tenants

    def has_key_hash(self, digest: str) -> bool:
        """Whether some tenant accepts the key with this SHA-256 hex digest."""
        return digest in self._table.by_hash
