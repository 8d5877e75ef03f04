"""Request bodies read as JSON that every later step can trust.

Python's json module accepts what OpenAI's API does not and what later code cannot handle: NaN
and Infinity, numbers that overflow to inf, integers of thousands of digits, lone UTF-16
surrogates (which no UTF-8 encoder, tokenizer or JSON response can carry) and nesting deep enough
to exhaust the stack. Each is refused here with a 400 that says where.
"""

from __future__ import annotations

import json
import math
from typing import Any

from anna.server.protocol import APIError

MAX_JSON_DEPTH = 64  # arrays and objects inside each other; real schemas and messages stay far below
INT_RANGE = (-(2**63), 2**64)  # every integer field (ids, counts, seeds) fits in 64 bits


def parse_json_body(raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"invalid JSON body: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        body = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise APIError(400, f"invalid JSON body: nested more than {MAX_JSON_DEPTH} levels deep") from None
    except ValueError as exc:  # JSONDecodeError, NaN/Infinity, and integers past Python's digit limit
        raise APIError(400, f"invalid JSON body: {exc}") from None
    check_json_value(body)
    return body


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def check_json_value(value: Any) -> None:
    """Walk a parsed body (without recursion) and refuse what later steps cannot carry."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, dict):
            if depth >= MAX_JSON_DEPTH:
                raise _bad(path, f"nested more than {MAX_JSON_DEPTH} levels deep")
            for key, child in item.items():
                child_path = f"{path}.{key}" if path else key
                if not _is_unicode(key):
                    raise _bad(path, "a key holds a lone UTF-16 surrogate, which is not Unicode text")
                stack.append((child, child_path, depth + 1))
        elif isinstance(item, list):
            if depth >= MAX_JSON_DEPTH:
                raise _bad(path, f"nested more than {MAX_JSON_DEPTH} levels deep")
            stack.extend((child, f"{path}[{i}]", depth + 1) for i, child in enumerate(item))
        elif isinstance(item, str):
            if not _is_unicode(item):
                raise _bad(path, "the string holds a lone UTF-16 surrogate, which is not Unicode text")
        elif isinstance(item, bool) or item is None:
            continue
        elif isinstance(item, int):
            if not INT_RANGE[0] <= item < INT_RANGE[1]:
                raise _bad(path, "the integer does not fit in 64 bits")
        elif isinstance(item, float) and not math.isfinite(item):
            raise _bad(path, "the number is too large to be represented")


def _is_unicode(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _bad(path: str, why: str) -> APIError:
    where = _printable(path)
    return APIError(400, f"{where}: {why}" if where else f"invalid JSON body: {why}", param=where or None)


def _printable(path: str) -> str:
    """The path with anything that is not valid text escaped, so that the error itself encodes."""
    return path.encode("utf-8", "backslashreplace").decode("utf-8")[:200]
