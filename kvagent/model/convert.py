"""One strict cattrs converter for kvagent's JSON values: status, identity, discovery records, slot holders.

Each value class stays a plain attrs class; its ``to_json``/``from_json`` call :func:`unstructure` and
:func:`structure` here (a class with a JSON shape of its own, like ``CacheOwnerId`` as its text, registers
its hooks next to its definition). Structuring is strict: an integer is a JSON integer in 0..2^64-1 (never a
boolean), a number is never a boolean, a string is a string, and an object may hold no key its class does not
declare. Every failure is one error of the caller's class naming the path of the first bad member,
``status.attachment.generation: must be a u64, got True``.

This module imports no value class (they import it), so the model package has no import cycle.
"""

from __future__ import annotations

from typing import Any, TypeVar

import attrs
import cattrs
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError
from cattrs.v import transform_error

from kvagent.model.errors import KvAgentError

__all__ = ["converter", "structure", "unstructure"]

_T = TypeVar("_T")
_U64_MAX = (1 << 64) - 1  # events.U64_MAX; events imports ids, which imports this module


class _Malformed(TypeError):
    """A scalar of the wrong JSON type or range; its message is shown as is."""


def _u64(value: object, _: type) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _U64_MAX:
        raise _Malformed(f"must be a u64, got {value!r}")
    return value


def _number(value: object, _: type) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _Malformed(f"must be a number, got {value!r}")
    return float(value)


def _string(value: object, _: type) -> str:
    if not isinstance(value, str):
        raise _Malformed(f"must be a string, got {value!r}")
    return value


def _boolean(value: object, _: type) -> bool:
    if not isinstance(value, bool):
        raise _Malformed(f"must be a boolean, got {value!r}")
    return value


def _make_converter() -> cattrs.Converter:
    made = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    made.register_structure_hook(int, _u64)
    made.register_structure_hook(float, _number)
    made.register_structure_hook(str, _string)
    made.register_structure_hook(bool, _boolean)
    return made


converter = _make_converter()


def register_object(
    cls: type,
    *,
    optional: tuple[str, ...] = (),
    what: str | None = None,
    error: type[KvAgentError] | None = None,
) -> None:
    """Structure ``cls`` from a JSON object holding every member but those named ``optional`` (an absent
    one takes the field's default), and nothing else. With ``error``, any problem inside it is that error
    (an identity's problems are ``IdentityError`` wherever the identity sits)."""
    generated = converter.get_structure_hook(cls)
    required = [field.name for field in attrs.fields(cls) if field.name not in optional]

    def structure_object(value: object, type_: Any) -> Any:
        if not isinstance(value, dict):
            raise _Malformed(f"must be an object, got {type(value).__name__}")
        missing = [key for key in required if key not in value]
        if missing:
            raise _Malformed(f"is missing {', '.join(map(repr, missing))}")
        return generated(value, type_)

    if error is None:
        converter.register_structure_hook(cls, structure_object)
        return
    name, kind = what or cls.__name__, error

    def structure_or_raise(value: object, type_: Any) -> Any:
        try:
            return structure_object(value, type_)
        except (cattrs.BaseValidationError, _Malformed) as exc:
            raise _as_error(exc, name, kind) from None

    converter.register_structure_hook(cls, structure_or_raise)


def _describe(exc: BaseException, type_: type | None) -> str:
    if isinstance(exc, _Malformed | KvAgentError | ValueError):
        return str(exc)
    if isinstance(exc, ForbiddenExtraKeysError):
        return f"has unknown members {', '.join(sorted(exc.extra_fields))}"
    if isinstance(exc, KeyError):
        return "is missing"
    return f"is malformed ({type(exc).__name__}: {exc})"


def _first_leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, ClassValidationError | IterableValidationError) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def structure(value: object, cls: type[_T], *, what: str, error: type[KvAgentError]) -> _T:
    """``value`` (decoded JSON) as a ``cls``; ``error("<what>.<path>: <problem>")`` if it is not one.

    An error of kvagent's own raised inside (an ``IdentityError`` of a malformed id) keeps its class.
    """
    try:
        return converter.structure(value, cls)
    except (cattrs.BaseValidationError, _Malformed) as exc:
        raise _as_error(exc, what, error) from None
    except KvAgentError as exc:  # raised by a registered object's own hook: already says where
        raise exc from None


def _validated_field(exc: BaseException) -> attrs.Attribute[Any] | None:
    """The field an attrs validator refused (its ValueError/TypeError carries the message, then the field)."""
    if isinstance(exc, ValueError | TypeError) and len(exc.args) >= 2 and isinstance(exc.args[1], attrs.Attribute):
        return exc.args[1]
    return None


def _as_error(exc: BaseException, what: str, error: type[KvAgentError]) -> KvAgentError:
    leaf = _first_leaf(exc)
    error_class = type(leaf) if isinstance(leaf, KvAgentError) else error
    if isinstance(exc, _Malformed):
        return error_class(f"{what} {exc}")
    message = transform_error(exc, path=what, format_exception=_describe)[0]  # "problem @ path"
    problem, _, path = message.rpartition(" @ ")
    field = _validated_field(leaf)
    if field is not None:  # an attrs validator's refusal: it names the field, cattrs only its object
        path, problem = f"{path}.{field.name}", str(leaf.args[0]).removeprefix(f"'{field.name}' ")
    return error_class(f"{path} {problem}" if problem.startswith(("is ", "has ", "must ")) else f"{path}: {problem}")


def unstructure(value: object) -> Any:
    """``value`` as plain JSON data (objects, lists, strings, numbers, booleans, null)."""
    return converter.unstructure(value)
