"""Request bodies that FastAPI does not parse for us: multipart forms and JSON-or-multipart video bodies.

Multipart fields arrive as strings. Bracketed keys as the OpenAI SDK writes them for ``extra_body``
(``model_params[tag]``) become nested objects; ``model_params``/``extra_params`` may also be a JSON string.
Repeated keys (``image[]``) become lists. File parts are returned separately with their bytes, each checked
against ``--max-upload-bytes``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from starlette.datastructures import UploadFile
from starlette.requests import Request

from ..json_types import JSON
from .errors import ApiError

_BRACKET = re.compile(r"^([A-Za-z_][\w]*)((?:\[[^\[\]]*\])*)$")
_JSON_FIELDS = ("model_params", "extra_params", "lora")
_LIST_FIELDS = ("image_url", "reference_images", "reference_video", "reference_audio")
#: lists of objects the openai SDK flattens to ``lora[][name]=a``, ``lora[][scale]=0.5``, ...: the keys that start
#: an object (each adapter names exactly one of them first, so the flat pairs regroup unambiguously)
_OBJECT_LISTS = {"lora": ("name", "path")}


MAX_JSON_DEPTH = 64  # no field of the contract nests anywhere near this deep


def _too_deep(param: str | None) -> ApiError:
    return ApiError(400, "invalid_value", f"the JSON is nested more than {MAX_JSON_DEPTH} levels deep", param=param)


def _depth_ok(data: object) -> bool:
    """Whether ``data`` nests at most :data:`MAX_JSON_DEPTH` levels (iterative: no recursion to exhaust)."""
    stack = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                return False
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return True


def _json_value(text: str, param: str | None = None) -> JSON:
    try:
        value = json.loads(text)
    except RecursionError:
        raise _too_deep(param) from None
    except ValueError:
        return text
    if not _depth_ok(value):
        raise _too_deep(param)
    return value


def _add_to_object_list(items: list[dict[str, object]], key: str, value: object, heads: tuple[str, ...]) -> None:
    """``key=value`` joins the last object, or starts a new one when the last already has ``key`` or a head key
    arrives for an object that has one."""
    last = items[-1] if items else None
    if last is None or key in last or (key in heads and any(h in last for h in heads)):
        items.append({key: value})
    else:
        last[key] = value


async def read_json(request: Request) -> dict[str, Any]:
    body = await request.body()
    if not body.strip():
        raise ApiError(400, "missing_required_parameter", "the request body is empty; send a JSON object "
                                                          "(at least {\"prompt\": ...})", param="prompt")
    try:
        data = json.loads(body)
    except RecursionError:  # the C parser gives up on very deep nesting: a client error, not a 500
        raise _too_deep(None) from None
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "invalid_value", "the body is not valid JSON") from None
    if not isinstance(data, dict):
        raise ApiError(400, "invalid_value", "the JSON body must be an object")
    if not _depth_ok(data):
        raise _too_deep(None)
    return data


async def read_multipart(request: Request, *, max_upload_bytes: int,
                         file_fields: tuple[str, ...]) -> tuple[dict[str, Any], dict[str, list[bytes]]]:
    """Parse a multipart body into (fields, files by field name)."""
    try:
        form = await request.form(max_files=64, max_fields=256, max_part_size=4 * 1024 * 1024)
    except ApiError:
        raise
    except Exception as exc:
        detail = getattr(exc, "detail", None) or str(exc) or type(exc).__name__
        raise ApiError(400, "invalid_value", f"cannot parse the multipart body: {detail}") from None
    fields: dict[str, Any] = {}
    files: dict[str, list[bytes]] = {}
    try:
        for key, value in form.multi_items():
            m = _BRACKET.match(key)
            if m is None:
                raise ApiError(400, "unknown_parameter", f"unknown parameter: {key}", param=key)
            name, brackets = m.group(1), m.group(2)
            parts = [p[1:-1] for p in re.findall(r"\[[^\[\]]*\]", brackets)]
            if len(parts) >= MAX_JSON_DEPTH:  # bracketed keys nest like JSON: the same depth rule
                raise _too_deep(name)
            if isinstance(value, UploadFile):
                if name not in file_fields:
                    raise ApiError(400, "invalid_value", f"{name} does not take a file upload", param=name)
                data = await value.read()
                if len(data) > max_upload_bytes:
                    raise ApiError(413, "upload_too_large", f"{name}: the file has {len(data)} bytes, more than "
                                                            f"the limit of {max_upload_bytes}", param=name)
                files.setdefault(name, []).append(data)
                continue
            if not parts:
                if name in _JSON_FIELDS:
                    fields[name] = _json_value(value, name)
                elif name in _LIST_FIELDS:
                    fields.setdefault(name, []).append(value)
                elif name in fields:
                    raise ApiError(400, "invalid_value", f"{name} was given more than once", param=name)
                else:
                    fields[name] = value
                continue
            if len(parts) == 2 and parts[0] == "" and name in _OBJECT_LISTS:  # lora[][name]=...
                items = fields.setdefault(name, [])
                if not isinstance(items, list) or any(not isinstance(i, dict) for i in items):
                    raise ApiError(400, "invalid_value", f"{name} was given both as a value and as a list",
                                   param=name)
                _add_to_object_list(items, parts[1], value, _OBJECT_LISTS[name])  # text: the schema parses it
                continue
            if parts == [""]:  # image_url[] = repeated value
                fields.setdefault(name, []).append(value)
                continue
            node = fields.setdefault(name, {})
            if not isinstance(node, dict):
                raise ApiError(400, "invalid_value", f"{name} was given both as a value and as an object",
                               param=name)
            for part in parts[:-1]:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    raise ApiError(400, "invalid_value", f"{key} conflicts with another field", param=name)
            node[parts[-1]] = _json_value(value, name)
    finally:
        await form.close()
    for name, value in fields.items():  # a bracketed key plus a JSON value may still add up to too deep
        if not _depth_ok(value):
            raise _too_deep(name)
    return fields, files


def is_multipart(request: Request) -> bool:
    """A form body: multipart (the OpenAI SDK, ``curl -F``) or urlencoded (``curl -d k=v``)."""
    ctype = request.headers.get("content-type", "").lower()
    return ctype.startswith(("multipart/form-data", "application/x-www-form-urlencoded"))


def is_json(request: Request) -> bool:
    ctype = request.headers.get("content-type", "").lower()
    return ctype.startswith("application/json") or ctype == ""
