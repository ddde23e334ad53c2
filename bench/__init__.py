"""kvagent benchmark suite: ``python -m bench [names...] [--quick]`` (see docs/performance.md)."""
