"""The typed state ``MiniMaxH3Pipeline.preprocess`` prepares for a request.

A prepared request carries an :class:`H3Plan` in its typed ``plan`` slot (``GenerationRequest.plan``): the request
rules' decisions and the decoded media, read back with :func:`plan_of`. The caller's ``extra`` stays the caller's
(it used to be replaced by the plan, so a prepared request no longer showed what the client asked for).
"""

from __future__ import annotations

from typing import Any

import attrs

from .request_rules import ResolvedRequest


@attrs.frozen
class H3Plan:
    """How one prepared request runs: ``resolved`` (task, canvas, frames, shifts, references) and ``media``, the
    decoded inputs in request order (RGB images, ``VideoReference`` clips, ``AudioClip`` s)."""

    resolved: ResolvedRequest
    media: tuple[Any, ...] = ()


def plan_of(request: Any) -> H3Plan:
    """The plan of a request prepared by ``MiniMaxH3Pipeline.preprocess`` (``ValueError`` for any other request)."""
    plan: H3Plan = request.plan_as(H3Plan)
    return plan


def resolved_of(request: Any) -> ResolvedRequest:
    """The rules' decisions for a prepared request (the part of the plan the batch key and the layout read)."""
    return plan_of(request).resolved
