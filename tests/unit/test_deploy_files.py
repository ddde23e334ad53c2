"""deploy/ is checked without docker, a cluster or systemd: each file parsed and validated by a library, and
every kvagent command line in it parsed by kvagent's own parser (so a renamed flag breaks this test)."""

from __future__ import annotations

import ast
import configparser
import json
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml  # type: ignore[import-untyped]  # PyYAML, installed with yamllint; no stubs here
from dockerfile_parse import DockerfileParser
from yamllint import linter
from yamllint.config import YamlLintConfig

from kvagent.cli.config import ServeConfig
from kvagent.cli.main import build_parser, serve_config_from_args

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes" / "vllm-kvagent.yaml"
UNIT = DEPLOY / "systemd" / "kvagent.service"
DASHBOARD = DEPLOY / "grafana" / "kvagent-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "kvagent-alerts.yaml"
ALERTS_TEST = DEPLOY / "prometheus" / "kvagent-alerts.test.yaml"
# Exported by the `obs` work of issue #19 (metrics.py may not define them on every branch yet).
NEW_METRICS = {"kvagent_slot_last_event_age_seconds", "kvagent_build_info"}
YAMLLINT = YamlLintConfig("extends: default\nrules:\n  line-length: {max: 160}\n  document-start: disable\n")


def serve_config(argv: list[str]) -> ServeConfig:
    """A ``kvagent serve`` command line as kvagent itself reads it (exits on an unknown flag)."""
    args = build_parser().parse_args(argv)
    assert args.command == "serve"
    return serve_config_from_args(args)


def lint(path: Path) -> None:
    problems = [f"{p.line}:{p.column} {p.message}" for p in linter.run(path.read_text(), YAMLLINT, str(path))]
    assert problems == [], problems


# --- Dockerfile ---------------------------------------------------------------------------------------


def dockerfile_stages() -> list[list[tuple[str, str]]]:
    """The Dockerfile's stages, each its (instruction, value) pairs from its FROM on (comments left out)."""
    stages: list[list[tuple[str, str]]] = []
    for item in DockerfileParser(str(DEPLOY / "Dockerfile")).structure:
        if item["instruction"] == "FROM":
            stages.append([])
        if item["instruction"] != "COMMENT":
            assert stages, "an instruction before the first FROM"
            stages[-1].append((item["instruction"], item["value"]))
    return stages


def test_dockerfile_builds_the_native_core_in_a_builder_stage() -> None:
    builder, runtime = dockerfile_stages()  # exactly two stages
    assert builder[0] == ("FROM", "python:3.11-slim AS builder")
    runs = " && ".join(value for instruction, value in builder if instruction == "RUN")
    # A C compiler and libxxhash's header (setup.py compiles XXH3 in from it), required, not merely tried.
    assert re.search(r"apt-get install .*\bgcc\b", runs) and "libxxhash-dev" in runs
    environment = " ".join(value for instruction, value in builder if instruction == "ENV")
    assert "KVAGENT_XXHASH=system" in environment
    assert "pip install" in runs and "/opt/kvagent" in runs
    # The build fails unless the installed kvagent runs its native core.
    assert re.search(r"kvagent --version .*grep -q \"native core: yes\$\"", runs), runs
    copied = [value.split() for instruction, value in builder if instruction == "COPY"]
    assert any("setup.py" in sources for *sources, _ in copied), "setup.py declares the extensions"
    for *sources, _target in copied:
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: not in the build context (the repository root)"


def test_dockerfile_runtime_stage_is_slim_non_root_with_kvagent_as_entrypoint() -> None:
    runtime = dockerfile_stages()[-1]
    assert runtime[0] == ("FROM", "python:3.11-slim")
    instructions = dict(runtime)
    # Only the builder's virtualenv comes in: no source, no compiler, no install from source here.
    copies = [value for instruction, value in runtime if instruction == "COPY"]
    assert copies == ["--from=builder /opt/kvagent /opt/kvagent"]
    runs = " ".join(value for instruction, value in runtime if instruction == "RUN")
    assert "pip install" not in runs and "apt-get" not in runs
    assert "PATH=/opt/kvagent/bin:" in instructions["ENV"]
    # Everything after the last USER runs unprivileged; the last RUN (writing /etc) comes before it.
    order = [instruction for instruction, _ in runtime]
    users = [value for instruction, value in runtime if instruction == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    last_run = max(i for i, instruction in enumerate(order) if instruction == "RUN")
    assert order.index("USER") > last_run
    assert json.loads(instructions["ENTRYPOINT"]) == ["kvagent"]
    # The default command is a serve command line kvagent accepts.
    command = json.loads(instructions["CMD"])
    assert command[0] == "serve"
    assert serve_config(command).slots[0].simulate


# --- Kubernetes ----------------------------------------------------------------------------------------


def k8s_documents() -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(K8S.read_text()) if doc is not None]


def test_kubernetes_example_lints_and_validates_against_the_api_schema() -> None:
    lint(K8S)
    documents = k8s_documents()
    assert {doc["kind"] for doc in documents} == {"Deployment", "Service"}
    for doc in documents:
        kubernetes_validate.validate(doc, "1.30", strict=True)


def kvagent_container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers: dict[str, dict[str, Any]] = {
        c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]
    }
    assert {"vllm", "kvagent"} <= set(containers), "a vLLM pod with a kvagent sidecar"
    return containers["kvagent"]


def test_kubernetes_probes_hit_the_http_surface_kvagent_is_told_to_serve() -> None:
    deployment = next(doc for doc in k8s_documents() if doc["kind"] == "Deployment")
    container = kvagent_container(deployment)
    config = serve_config(container["args"])
    http_port = int(str(config.http).rpartition(":")[2])
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": http_port}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": http_port}
    assert container["securityContext"]["runAsNonRoot"] is True
    # The engine's event endpoint must be a bind address for vLLM (it connects for anything else) and the
    # sidecar's slot must point at that port on localhost.
    vllm = next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm")
    events = next(arg for arg in vllm["args"] if arg.startswith("--kv-events-config="))
    engine = json.loads(events.partition("=")[2])
    assert engine["endpoint"].startswith("tcp://*:")
    slot = config.slots[0]
    assert slot.engine is not None
    assert slot.engine.endpoint == "tcp://127.0.0.1:" + engine["endpoint"].rpartition(":")[2]
    assert slot.engine.replay_endpoint == "tcp://127.0.0.1:" + engine["replay_endpoint"].rpartition(":")[2]


# --- systemd --------------------------------------------------------------------------------------------


def test_systemd_unit_runs_kvagent_serve_unprivileged() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    unit.optionxform = str  # type: ignore[assignment,method-assign]  # systemd keys are case-sensitive
    unit.read_string(UNIT.read_text())
    assert set(unit.sections()) == {"Unit", "Service", "Install"}
    service = unit["Service"]
    assert service["User"] not in ("root", "0")
    assert service["KillSignal"] == "SIGTERM"
    assert service["RestartPreventExitStatus"] == "2"  # a usage mistake is not fixed by restarting
    argv = shlex.split(service["ExecStart"].replace("\\\n", " "))
    assert Path(argv[0]).name == "kvagent" and argv[1] == "serve"
    assert serve_config(argv[1:]).slots[0].name == "gpu0"
    assert unit["Install"]["WantedBy"] == "multi-user.target"


# --- Grafana and Prometheus: only metrics kvagent exports -----------------------------------------------


def exported_metric_names() -> set[str]:
    """Metric family names kvagent/agent/metrics.py can produce, read from its source.

    Families are named by literals (``"kvagent_recovery_connections_open"``) or composed from
    ``kvagent_`` + a table entry (``"events_in"``), possibly with a component prefix in between
    (``"persistence"`` + ``"lag_events"``); each composition is taken from the literals in the module.
    """
    tree = ast.parse((ROOT / "kvagent" / "agent" / "metrics.py").read_text())
    words = {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and re.fullmatch(r"[a-z_]+", node.value)
    }
    # The constant heads of f-strings (``f"kvagent_persistence_{name}"``) are prefixes, not names.
    prefixes = {w for w in words if w.startswith("kvagent_") and w.endswith("_")}
    names = {w for w in words if w.startswith("kvagent_")} - prefixes
    names |= {prefix + w for prefix in prefixes for w in words}
    names |= {f"kvagent_{a}_{b}" for a in words for b in words}  # f"kvagent_{prefix}_{name}"
    return names | NEW_METRICS


def metric_names(expr: str) -> set[str]:
    """The kvagent series an expression reads, with the exposition suffixes (_total, histogram parts) off."""
    found = set(re.findall(r"\bkvagent_[a-z0-9_]+\b", expr))
    return {re.sub(r"_(total|bucket|sum|count)$", "", name) for name in found}


def dashboard_exprs(value: object) -> Iterator[str]:
    if isinstance(value, dict):
        for key, item in value.items():
            if key in ("expr", "definition") and isinstance(item, str):
                yield item
            elif key == "query" and isinstance(item, str | dict):
                yield from ([item] if isinstance(item, str) else dashboard_exprs(item))
            else:
                yield from dashboard_exprs(item)
    elif isinstance(value, list):
        for item in value:
            yield from dashboard_exprs(item)


def test_the_metric_name_reader_tells_real_names_from_typos() -> None:
    names = exported_metric_names()
    assert {"kvagent_events_in", "kvagent_persistence_lag_events", "kvagent_recovery_requests"} <= names
    assert "kvagent_events_inn" not in names and "kvagent_resident_block" not in names


def test_grafana_dashboard_loads_and_reads_only_kvagent_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["panels"]
    exprs = [e for e in dashboard_exprs(dashboard) if e != "prometheus"]  # the datasource variable's type
    assert len(exprs) >= 10
    known = exported_metric_names()
    for expr in exprs:
        used = metric_names(expr)
        assert used, f"reads no kvagent metric: {expr}"
        assert used <= known, f"{expr}: {sorted(used - known)} not exported by kvagent"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    # Panels do not overlap on Grafana's 24-column grid.
    cells: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
        area = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not cells & area, panel["title"]
        cells |= area


def alert_rules() -> list[dict[str, Any]]:
    document = yaml.safe_load(ALERTS.read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def test_alert_rules_are_well_formed_and_cover_the_issue() -> None:
    lint(ALERTS)
    document = yaml.safe_load(ALERTS.read_text())
    assert [sorted(group) for group in document["groups"]] == [["name", "rules"]]
    known = exported_metric_names()
    for rule in alert_rules():
        assert re.fullmatch(r"[A-Z][A-Za-z]+", rule["alert"])
        used = metric_names(rule["expr"])
        assert used and used <= known, rule["expr"]
        assert re.fullmatch(r"\d+[smh]", str(rule.get("for", "0s")))
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        assert rule["expr"].count("(") == rule["expr"].count(")")
    by_name = {rule["alert"]: rule["expr"] for rule in alert_rules()}
    assert 'state=~"degraded' in by_name["KvagentSlotDegraded"]
    assert "kvagent_slot_last_event_age_seconds > 60" in by_name["KvagentEngineSilent"]
    assert "kvagent_lost_batches" in by_name["KvagentRepairFailing"]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed (Debian: prometheus)")
def test_promtool_accepts_the_alert_rules_and_they_fire_on_what_they_should() -> None:
    result = subprocess.run(["promtool", "check", "rules", str(ALERTS)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    # Synthetic series: degraded for 5 minutes, an engine silent past 60 s, a lost batch (and not before).
    lint(ALERTS_TEST)
    result = subprocess.run(
        ["promtool", "test", "rules", ALERTS_TEST.name],
        cwd=ALERTS_TEST.parent,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
