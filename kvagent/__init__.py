"""kvagent: a durable, recoverable source of truth for the KV-cache blocks of every vLLM DP slot."""

from __future__ import annotations

__version__ = "0.1.0"
