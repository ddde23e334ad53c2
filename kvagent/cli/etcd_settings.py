"""``[etcd]`` / ``--etcd-*``: the options of an etcd discovery backend (docs/discovery.md, "Options")."""

from __future__ import annotations

from pathlib import Path

import attrs

from kvagent.model.errors import ConfigError

__all__ = ["EtcdSettings", "etcd_open_options", "etcd_problems"]


@attrs.frozen(slots=True)
class EtcdSettings:
    """``[etcd]``: options of an ``etcd://``/``etcds://`` discovery (docs/discovery.md, "Options")."""

    ttl: float | None = None  # None: open_etcd_discovery's default (10 s)
    username: str | None = None
    password_file: str | None = None  # read at start; the password itself never sits in the config
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None


_ETCD_FLAGS = {
    "ttl": "--etcd-ttl",
    "username": "--etcd-user",
    "password_file": "--etcd-password-file",
    "ca_file": "--etcd-ca",
    "cert_file": "--etcd-cert",
    "key_file": "--etcd-key",
}


def etcd_problems(etcd: EtcdSettings, discovery: str) -> list[str]:
    """Every inconsistency of ``[etcd]`` with itself and with the discovery URL, each naming key and flag."""
    errors: list[str] = []
    given = [key for key in _ETCD_FLAGS if getattr(etcd, key) is not None]
    if not given:
        return errors
    if not discovery.startswith(("etcd://", "etcds://")):
        errors.extend(
            f"etcd.{key} ({_ETCD_FLAGS[key]}): needs an etcd:// or etcds:// discovery URL, "
            f"discovery is {discovery!r}"
            for key in given
        )
        return errors
    if etcd.ttl is not None and etcd.ttl < 1:
        errors.append(f"etcd.ttl (--etcd-ttl): must be at least 1 second, got {etcd.ttl}")
    if (etcd.username is None) != (etcd.password_file is None):
        errors.append("etcd.username (--etcd-user) and etcd.password_file (--etcd-password-file) go together")
    if not discovery.startswith("etcds://"):
        errors.extend(
            f"etcd.{key} ({_ETCD_FLAGS[key]}): TLS files need an etcds:// discovery URL"
            for key in ("ca_file", "cert_file", "key_file")
            if getattr(etcd, key) is not None
        )
    if etcd.key_file is not None and etcd.cert_file is None:
        errors.append("etcd.key_file (--etcd-key): needs etcd.cert_file (--etcd-cert)")
    return errors


def _read_secret(path: str, key: str) -> str:
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"{key}: cannot read {path}: {reason}") from None
    secret = text.rstrip("\r\n")  # a trailing newline is the editor's, not the password's
    if not secret:
        raise ConfigError(f"{key}: {path} is empty")
    return secret


def etcd_open_options(etcd: EtcdSettings) -> dict[str, object]:
    """The keyword options of ``open_etcd_discovery``; reads the password file (ConfigError naming it)."""
    options: dict[str, object] = {
        key: getattr(etcd, key)
        for key in ("ttl", "username", "ca_file", "cert_file", "key_file")
        if getattr(etcd, key) is not None
    }
    if etcd.password_file is not None:
        options["password"] = _read_secret(etcd.password_file, "etcd.password_file (--etcd-password-file)")
    return options
