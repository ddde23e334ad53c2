"""The control token of ``kvagent serve``: kept in a 0600 file, never printed (issue #19)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import attrs
import structlog

from kvagent.cli.config import ServeConfig, default_state_dir
from kvagent.cli.errors import EXIT_USAGE, CliError, blaming
from kvagent.cli.logs import Console

__all__ = ["ControlToken", "load_or_create_token", "token_path"]

log = structlog.get_logger(__name__)


def token_path(config: ServeConfig) -> Path:
    """Where the control token lives: ``--token-file``, else ``<state root>/token``."""
    return Path(config.token_file).expanduser() if config.token_file else default_state_dir() / "token"


@attrs.frozen(slots=True)
class ControlToken:
    value: str = attrs.field(repr=False)  # never printed nor logged
    path: Path
    created: bool

    def announce(self, console: Console) -> None:
        """Only the path: the token itself never goes to stderr, where logs are collected (issue #19)."""
        console.line(
            "control_token",
            f"kvagent: control token {'created in' if self.created else 'read from'} {self.path} (send it as "
            f"'Authorization: Bearer <token>', or pass --token-file {self.path} to kvagent query)",
            path=str(self.path),
            created=self.created,
        )


def load_or_create_token(path: Path) -> tuple[str, bool]:
    """The control token in ``path``, and whether it was just created there (mode 0600, a fresh token).

    The token is never printed: the console names only the file (issue #19).
    """
    with blaming("--token-file", path, what="the control token file"):
        if path.exists():
            token = path.read_text().strip()
            if not token:
                raise CliError(
                    f"--token-file {path} is empty: write a token into it, or delete it to have one created",
                    exit_status=EXIT_USAGE,
                )
            if path.stat().st_mode & 0o077:
                log.warning("token_file_readable_by_others", path=str(path), fix=f"chmod 600 {path}")
            return token, False
        token = secrets.token_urlsafe(32)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another serve sharing the state root created it meanwhile: use that one
            return path.read_text().strip(), False
        with os.fdopen(fd, "w") as handle:
            handle.write(token + "\n")
        return token, True
