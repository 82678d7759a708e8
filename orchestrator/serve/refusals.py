"""A client's invalid value, refused in kvtide's words: ``invalid_request`` turns the
first of pydantic's validation errors into a 400 (``InvalidRequest``, or
``UnsupportedParameter`` for a field kvtide does not honour) whose ``param`` names the
field and whose message says what would fix it, with the value as ``shown`` renders it
(short, JSON-spelled, never a lone surrogate). Pydantic's own wording never reaches the
client: a kind of error without a phrase here is reworded (``_own``)."""

from __future__ import annotations

import json

from pydantic import ValidationError

from orchestrator.errors import InvalidRequest, UnsupportedParameter

__all__ = ["invalid_request", "shown"]


def shown(value: object) -> str:
    """A short, safe rendering of a client's value for an error message: JSON spelling,
    at most ~40 characters of a string, never a lone surrogate, never a huge number."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int):
        digits = len(str(abs(value)))  # callers bound ints to 4,300 digits
        return str(value) if digits <= 24 else f"an integer of {digits} digits"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        text = json.dumps(value[:40])  # ensure_ascii: a lone surrogate becomes an escape
        return text if len(value) <= 40 else text[:-1] + '..."'
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return "a value of another type"


_PHRASES = {
    "missing": "is required",
    "extra_forbidden": "is not a field kvtide accepts: remove it (docs/api.md lists the "
    "fields kvtide honours and the ones it refuses)",
    "bool_type": "must be true or false (a JSON boolean, not a string or a number)",
    "int_type": "must be an integer",
    "float_type": "must be a number",
    "finite_number": "must be a finite number",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "dict_type": "must be a JSON object",
    "model_type": "must be a JSON object",
    "greater_than_equal": "must be >= {ge}",
    "greater_than": "must be > {gt}",
    "less_than_equal": "must be <= {le}",
    "less_than": "must be < {lt}",
    "too_short": "must not be empty",
    "too_long": "must have at most {max_length} items",
    "string_too_short": "must not be empty",
    "string_too_long": "must be at most {max_length} characters",
    "literal_error": "must be one of {expected}",
    "string_unicode": "holds a key or string that is not valid Unicode (a lone UTF-16 "
    "surrogate escape, \\ud800-\\udfff); send valid Unicode",
    "bool_parsing": "must be true or false",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer, not a fraction",
    "float_parsing": "must be a number",
    "enum": "must be one of {expected}",
}
_NO_INPUT = {"missing", "extra_forbidden", "too_long", "too_short", "string_unicode"}


def _param(loc: tuple[int | str, ...]) -> str | None:
    """``("messages", 0, "content")`` → ``messages[0].content``; a client's unknown key
    is cut short and escaped (it is echoed back)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            name = part if part.isprintable() and len(part) <= 64 else shown(part)
            out += f".{name}" if out else name
    return out or None


def _own(msg: str) -> str:
    """A validation message kvtide has no phrase for, in kvtide's wording: pydantic's
    "Input should be ..." as "must be ...", its "Value error, " prefix dropped."""
    msg = msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if msg.startswith("Input should"):
        msg = "must" + msg.removeprefix("Input should")
    return msg


def invalid_request(exc: ValidationError) -> InvalidRequest:
    """The first of pydantic's errors as a 400 naming the field."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    param = _param(first["loc"])
    kind = first["type"]
    phrase = (
        _PHRASES[kind].format(**first.get("ctx", {})) if kind in _PHRASES else _own(first["msg"])
    )
    message = f"{param or 'the request body'} {phrase}"
    if kind not in _NO_INPUT:
        message += f", got {shown(first['input'])}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem(s))"
    if kind in ("kvtide_unsupported", "extra_forbidden"):
        return UnsupportedParameter(message, param=param)
    return InvalidRequest(message, param=param)
