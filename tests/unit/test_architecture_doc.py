"""docs/architecture.md stays true: every module of kvagent/ is named in its package tree, the tree names no
module that does not exist, and the specifications the code cites resolve inside the repository."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "kvagent"
DOC = REPO / "docs" / "architecture.md"


def _tree_block() -> list[str]:
    text = DOC.read_text()
    section = text.split("## The package tree", 1)[1]
    return section.split("```", 2)[1].strip("\n").splitlines()[1:]  # without the "kvagent/" root line


def _named_in_tree() -> set[str]:
    """Module paths relative to kvagent/ ("vllm/reader.py", "testing.py") that the tree names."""
    named: set[str] = set()
    package = ""
    for line in _tree_block():
        head, _, rest = line.strip().partition(" ")
        if len(line) - len(line.lstrip()) > 2:  # a continuation line of the package above
            names = line
        elif head.endswith("/"):
            package = head
            names = rest
        elif head.endswith(".py"):
            named.add(head)
            continue
        else:
            continue
        named.update(package + name for name in re.findall(r"\w+\.(?:pyx|py)\b", names))
    return named


def _modules() -> set[str]:
    found = {
        str(path.relative_to(PACKAGE))
        for path in [*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.pyx")]
        if "__pycache__" not in path.parts
    }
    return {name for name in found if not name.endswith("__init__.py")}


def test_every_module_is_named_in_the_package_tree() -> None:
    assert sorted(_modules() - _named_in_tree()) == []


def test_the_package_tree_names_no_missing_module() -> None:
    assert sorted(name for name in _named_in_tree() - _modules() if not name.endswith("__init__.py")) == []


def test_every_package_has_a_paragraph() -> None:
    text = DOC.read_text()
    packages = sorted(
        path.name for path in PACKAGE.iterdir() if path.is_dir() and (path / "__init__.py").exists()
    )
    assert [name for name in packages if f"**`{name}/`**" not in text] == []


CITED_DOC = re.compile(r"docs/[\w/.-]+\.md")
FOREIGN_SPEC = re.compile(r"TRUST-SPEC|\.\./shared/|shared/reference|(?<![/\w])agent-semantics(?:\.md)?\s+§?\d")


def _sources() -> list[Path]:
    roots = [PACKAGE, REPO / "tests", REPO / "bench", REPO / "examples", REPO / "docs"]
    files = [path for root in roots for path in root.rglob("*") if path.suffix in {".py", ".pyx", ".md"}]
    return [*files, REPO / "README.md"]


def test_cited_docs_exist() -> None:
    missing = sorted(
        {
            f"{path.relative_to(REPO)}: {cited}"
            for path in _sources()
            if "docs/spec" not in str(path)  # the copied specifications cite Dynamo's and vLLM's own docs
            for cited in CITED_DOC.findall(path.read_text())
            if not (REPO / cited).exists()
        }
    )
    assert missing == []


def test_no_citation_of_a_specification_outside_the_repository() -> None:
    this = Path(__file__).resolve()
    offenders = sorted(
        f"{path.relative_to(REPO)}: {match.group(0)}"
        for path in _sources()
        if path.resolve() != this and "docs/spec" not in str(path)
        for match in FOREIGN_SPEC.finditer(path.read_text())
    )
    assert offenders == []
