"""Each structured constant of kvagent/ is defined once: a module that needs another's constant imports it.

A copy is how END_SEQ, the tier and domain lookups and the recovery event templates came to exist twice
(issue #26). Caught here: two modules whose module-level constants (UPPER_CASE, private or not) are the
same expression, for values with a shape of their own (bytes and strings, containers, comprehensions, calls
with only literal arguments). Plain numbers, which agree by coincidence, and empty containers are left out.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import kvagent

PACKAGE = Path(kvagent.__file__).resolve().parent


def _literal(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return all(_literal(element) for element in node.elts)
    if isinstance(node, ast.UnaryOp):
        return _literal(node.operand)
    return isinstance(node, ast.BinOp) and _literal(node.left) and _literal(node.right)


def _has_a_shape(node: ast.expr) -> bool:
    """Worth pairing: not a plain number (nor arithmetic of numbers), not an empty container, not a call
    with arguments other than literals (``object()`` sentinels and ``TypeVar("T")`` are per module)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str | bytes) and len(node.value) > 0
    if isinstance(node, ast.BinOp):
        return _has_a_shape(node.left) or _has_a_shape(node.right)
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return bool(node.elts) and _literal(node)
    if isinstance(node, ast.Dict):
        return bool(node.keys)
    if isinstance(node, ast.DictComp | ast.SetComp | ast.ListComp | ast.GeneratorExp):
        return True
    if isinstance(node, ast.Call):
        if isinstance(node.func, ast.Name) and node.func.id in ("TypeVar", "object"):
            return False
        return bool(node.args) and all(_literal(arg) for arg in node.args) and not node.keywords
    return False


def constants(package: Path) -> dict[str, list[str]]:
    """Expression -> every ``module:NAME`` that defines a module-level constant as that expression."""
    found: dict[str, list[str]] = defaultdict(list)
    for path in sorted(package.rglob("*.py")):
        module = path.relative_to(package.parent).with_suffix("").as_posix().replace("/", ".")
        for statement in ast.parse(path.read_text()).body:
            if isinstance(statement, ast.Assign):
                targets, value = statement.targets, statement.value
            elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
                targets, value = [statement.target], statement.value
            else:
                continue
            for target in targets:
                if isinstance(target, ast.Name) and target.id.lstrip("_").isupper() and _has_a_shape(value):
                    found[ast.unparse(value)].append(f"{module}:{target.id}")
    return found


def copies(package: Path) -> dict[str, list[str]]:
    return {
        expression: names
        for expression, names in constants(package).items()
        if len({name.partition(":")[0] for name in names}) > 1
    }


def test_no_module_copies_another_modules_constant() -> None:
    assert copies(PACKAGE) == {}


def test_a_copied_constant_is_found(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "low.py").write_text(
        'END_SEQ = b"\\xff" * 8\nLIMIT = 1 << 20\nNAMES = {t.value: t for t in T}\n'
    )
    (package / "high.py").write_text(
        '_END = b"\\xff" * 8\nOTHER = 1 << 20\nNAMES = {t.value: t for t in T}\n'
    )
    assert copies(package) == {
        "b'\\xff' * 8": ["pkg.high:_END", "pkg.low:END_SEQ"],
        "{t.value: t for t in T}": ["pkg.high:NAMES", "pkg.low:NAMES"],
    }
