"""``[etcd]`` / ``--etcd-*``: the options of an etcd discovery backend (docs/discovery.md, "Options")."""

from __future__ import annotations

from pathlib import Path

import attrs

from kvagent.cli.options import Scope, scoped_options, setting
from kvagent.model.errors import ConfigError

__all__ = ["EtcdSettings", "etcd_open_options", "etcd_problems"]


@attrs.frozen(slots=True)
class EtcdSettings:
    """``[etcd]``: options of an ``etcd://``/``etcds://`` discovery (docs/discovery.md, "Options")."""

    ttl: float | None = setting(
        None,
        help="lease TTL in seconds (at least 1)",
        flags=("--etcd-ttl",),
        metavar="SECONDS",
        parse=float,
        default_text="10",  # None: open_etcd_discovery's default
    )
    username: str | None = setting(
        None, help="etcd user (with --etcd-password-file)", flags=("--etcd-user",), metavar="NAME"
    )
    # Read at start; the password itself never sits in the config.
    password_file: str | None = setting(
        None, help="file holding the etcd user's password", flags=("--etcd-password-file",), metavar="FILE"
    )
    ca_file: str | None = setting(
        None, help="CA bundle verifying etcd (etcds:// only)", flags=("--etcd-ca",), metavar="FILE"
    )
    cert_file: str | None = setting(
        None, help="client certificate (etcds:// only)", flags=("--etcd-cert",), metavar="FILE"
    )
    key_file: str | None = setting(
        None, help="client certificate's key (etcds:// only)", flags=("--etcd-key",), metavar="FILE"
    )


# key -> its flag, for the messages
_ETCD_FLAGS = {
    field.name: declared.flags[0] for _, field, declared in scoped_options(EtcdSettings, Scope.ETCD)
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
