"""Video jobs: create (JSON or multipart), list, retrieve, content, events, cancel, delete, sync."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Literal

import anyio
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from ..ids import new_id
from ..jobstore.base import DuplicateKey
from . import video_media
from .auth import Principal
from .errors import ApiError, is_storage_full, pydantic_to_api, storage_full_error
from .eta import with_queue_info
from .forms import is_json, is_multipart, read_json, read_multipart
from .http_edge import RangeFileResponse
from .jobs import PROGRESS_KEYS, LiveJob
from .replica import accepted, cancel_remote, is_shared, poll_events
from .routes_images import job_failure, wait_or_disconnect
from .schemas import (
    ErrorResponse,
    VideoCreateRequest,
    VideoDeleted,
    VideoDeletePending,
    VideoJob,
    VideoList,
    video_body_openapi,
)
from .sse import encode_event
from .store import TERMINAL
from .translate import video_request

if TYPE_CHECKING:
    from ..engine.request import GenerationRequest, SamplingParams
    from .app import ServerContext
    from .translate import ServedModel

router = APIRouter(tags=["videos"])
_ERRORS: dict[int | str, dict[str, object]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 408, 409, 413, 415, 429, 500, 503, 504, 507)}
_BODY = video_body_openapi()


# ---------------------------------------------------------------------------------------------- parsing
async def _parse(request: Request) -> tuple[VideoCreateRequest, list[tuple[str, bytes]], str]:
    """The DTO, the raw conditioning media as ``(field, bytes)``, and a hash of the whole body (Idempotency-Key)."""
    ctx = request.app.state.ctx
    files: dict[str, list[bytes]] = {}
    if is_multipart(request):
        fields, files = await read_multipart(request, max_upload_bytes=ctx.settings.max_upload_bytes,
                                             file_fields=video_media.FILE_FIELDS)
        video_media.json_fields_from_multipart(fields)
        digest_src = json.dumps(fields, sort_keys=True, default=str).encode() + b"".join(
            name.encode() + hashlib.sha256(r).digest() for name, rs in sorted(files.items()) for r in rs)
    elif is_json(request):
        fields = await read_json(request)
        digest_src = json.dumps(fields, sort_keys=True, default=str).encode()
    else:
        raise ApiError(415, "unsupported_media_type", "send application/json or multipart/form-data")
    try:
        dto = VideoCreateRequest.model_validate(fields)
    except ValidationError as exc:
        raise pydantic_to_api(exc) from None
    return dto, video_media.collect(dto, files), hashlib.sha256(digest_src).hexdigest()


def _seconds_text(params: SamplingParams, dto_seconds: int | str | None) -> str:
    if dto_seconds is not None:
        return str(int(dto_seconds))
    if params.duration:
        return f"{params.duration:g}"
    if params.num_frames and params.fps:
        return f"{params.num_frames / params.fps:.3g}"
    return "0"


def _effective(params: SamplingParams, dto: VideoCreateRequest) -> dict[str, Any]:
    return {"size": f"{params.width}x{params.height}" if params.width else (dto.size or "auto"),
            "fps": params.fps, "num_frames": params.num_frames, "seconds": _seconds_text(params, dto.seconds),
            "seed": params.seed, "total_steps": params.num_inference_steps}


def _new_record(job_id: str, dto: VideoCreateRequest, greq: GenerationRequest, model: str) -> dict[str, object]:
    now = int(time.time())
    return {"id": job_id, "object": "video", "model": model, "prompt": dto.prompt, "status": "queued",
            "progress": 0, "phase": "queued", "phase_progress": None, "step": None, "queue_position": None,
            "cancel_requested": False, "created_at": now, "started_at": None, "updated_at": now,
            "completed_at": None, "expires_at": None, "error": None, "media_type": "video/mp4", "timings": {},
            "usage": {}, **_effective(greq.params, dto)}


def rebuild_request(ctx: ServerContext, job_id: str, served: ServedModel | None = None) -> GenerationRequest:
    """The ``GenerationRequest`` of a persisted queued job (restart re-enqueue), from its stored body and inputs;
    ``served``: the model it was queued for (default: the server's model)."""
    doc = ctx.store.get_request(job_id)
    if doc is None:
        raise KeyError(job_id)
    served = served if served is not None else ctx.served
    assert served is not None  # (a server re-enqueues only once it serves a model)
    dto = VideoCreateRequest.model_validate(doc["body"])
    media = video_media.decode(video_media.load_persisted(doc.get("inputs", [])), served, ctx.settings,
                               admitted=True)  # accepted before the restart: counted, never refused by the budget
    return video_request(dto, served, ctx.settings, request_id=job_id, media=media)


def _with_position(ctx: ServerContext, record: dict[str, Any]) -> dict[str, Any]:
    """``queue_position`` and ``eta_s`` filled in (from the shared store when replicas share one: server/eta.py)."""
    return with_queue_info(ctx, record)


def principal_of(request: Request) -> Principal | None:
    """The caller's :class:`~.auth.Principal` (set by the edge when keys are configured), else ``None``."""
    return request.scope.get("state", {}).get("principal")


def _scope(ctx: ServerContext, request: Request) -> tuple[bool, str | None]:
    """``(all_owners, owner)`` the caller may list. Without keys there is no isolation (every job is visible);
    with keys a caller sees the jobs its key created, and an admin key sees all (ownerless ones included)."""
    principal = principal_of(request)
    if not ctx.auth.enabled:
        return True, None
    if principal is None:
        return False, None  # (cannot happen: every /v1 route needs a key) sees nothing
    return principal.admin, principal.key_id


def _visible(ctx: ServerContext, request: Request, job_id: str) -> bool:
    """Whether the caller may see ``job_id`` (the same rule as :func:`_scope`, via ``Principal.may_see``)."""
    exists, owner = ctx.store.get_owner(job_id)
    if not exists:
        return False
    if not ctx.auth.enabled:
        return True
    principal = principal_of(request)
    return principal is not None and principal.may_see(owner)


def _overlay(ctx: ServerContext, record: dict[str, Any]) -> dict[str, Any]:
    """A terminal status the store could not take yet (disk full) wins over the stored record."""
    pending = ctx.jobs.unwritten(record["id"]) if ctx.jobs is not None else None
    return {**record, **pending} if pending else record


def _get_record(ctx: ServerContext, job_id: str, request: Request) -> dict[str, Any]:
    """The job's record, or 404 when it does not exist or belongs to another API key (the same answer, so a
    key cannot probe for other keys' job ids)."""
    record = ctx.store.get(job_id)
    if record is None or not _visible(ctx, request, job_id):
        raise ApiError(404, "job_not_found", f"no video job {job_id!r}", param="video_id")
    return _overlay(ctx, record)


# ---------------------------------------------------------------------------------------------- routes
@router.post("/v1/videos", response_model=VideoJob, responses=_ERRORS, openapi_extra=_BODY)
async def create_video(request: Request) -> JSONResponse | dict[str, object]:  # (response_model: VideoJob)
    """Create an asynchronous video job (status ``queued``); poll it, stream its events or cancel it."""
    ctx = request.app.state.ctx
    jobs, served = ctx.require()
    dto, raw, digest = await _parse(request)
    served = ctx.served_for(dto.model)  # (several models: the one `model` names)
    principal = principal_of(request)
    owner = principal.key_id if principal is not None else None
    idem = request.headers.get("idempotency-key")
    if idem and owner:  # each key has its own Idempotency-Key space: another key's key never matches
        idem = f"{owner}:{idem}"
    if idem:
        found = ctx.store.find_idempotent(idem)
        if found is not None:
            if found[1] != digest:
                raise ApiError(409, "idempotency_key_reused", "this Idempotency-Key was used with a different body")
            return _with_position(ctx, _get_record(ctx, found[0], request))
    media = await anyio.to_thread.run_sync(video_media.decode, raw, served, ctx.settings)
    job_id = new_id("video")
    greq = video_request(dto, served, ctx.settings, request_id=job_id, media=media)
    body = dto.model_dump(mode="json", exclude_none=True, exclude=set(video_media.FILE_FIELDS))
    body["seed"] = greq.params.seed
    created = _new_record(job_id, dto, greq, served.id)
    # Persist the request and its inputs before the job exists for anyone (restart re-enqueues it). A full disk
    # is the client's 507 storage_full, with nothing left behind (no record, no partial upload).
    try:
        inputs = video_media.persist(ctx.store.inputs_dir(job_id), raw) if raw else []
        ctx.store.insert(created, {"body": body, "inputs": inputs}, idempotency_key=idem, body_hash=digest,
                         owner=owner)
    except (sqlite3.IntegrityError, DuplicateKey):  # a concurrent request with the same Idempotency-Key won
        ctx.store.delete(job_id)
        ctx.store.remove_inputs(job_id)
        found = ctx.store.find_idempotent(idem or "")
        if found is None or found[1] != digest:
            raise ApiError(409, "idempotency_key_reused", "this Idempotency-Key was used with a different body") \
                from None
        return _with_position(ctx, _get_record(ctx, found[0], request))
    except Exception as exc:
        ctx.store.remove_inputs(job_id)
        if is_storage_full(exc):
            raise storage_full_error(exc) from None
        raise
    if is_shared(ctx):  # replicas share the queue: whichever has a free slot claims it (server/replica.py)
        return JSONResponse(accepted(ctx, dict(created, **_effective(greq.params, dto))),
                            headers={"Location": f"/v1/videos/{job_id}"})
    live = LiveJob(id=job_id, kind="video", task="video.generate", persisted=True, deadline_s=dto.timeout_s,
                   owner=owner, model=ctx.model_key(served))
    try:
        await anyio.to_thread.run_sync(jobs.submit, live, greq)
    except BaseException:
        try:
            ctx.store.delete(job_id)  # never accepted: nothing to keep
        finally:
            ctx.store.remove_inputs(job_id)
        raise
    effective = _effective(live.engine_job.request.params, dto)  # after the model's preprocess filled defaults
    try:
        ctx.store.update(job_id, **effective)
    except Exception as exc:  # the job is admitted and runs; the stored record keeps the requested values
        if not is_storage_full(exc):
            raise
    # creation answers with the job as created, `queued`; the worker may already have started it,
    # which the next GET (or the event stream) reports. The status only ever moves forward from here.
    position = jobs.queue_position(job_id)
    response = dict(created, **effective, queue_position=position if position is not None else 0)
    return JSONResponse(response, headers={"Location": f"/v1/videos/{job_id}"})


@router.get("/v1/videos", response_model=VideoList, responses=_ERRORS)
async def list_videos(
    request: Request,
    after: str | None = Query(default=None, max_length=64),
    limit: int = Query(default=20, ge=1, le=100),
    order: Literal["asc", "desc"] = "desc",
    status: Literal["queued", "in_progress", "completed", "failed", "cancelled"] | None = None,
) -> dict[str, object]:  # (response_model: VideoList)
    ctx = request.app.state.ctx
    all_owners, owner = _scope(ctx, request)
    records, more = ctx.store.list(after=after, limit=limit, order=order, status=status, owner=owner,
                                   all_owners=all_owners)
    data = [_with_position(ctx, _overlay(ctx, r)) for r in records]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}


@router.get("/v1/videos/{video_id}", response_model=VideoJob, responses=_ERRORS)
async def retrieve_video(video_id: str, request: Request) -> dict[str, object]:  # (response_model: VideoJob)
    ctx = request.app.state.ctx
    return _with_position(ctx, _get_record(ctx, video_id, request))


@router.get("/v1/videos/{video_id}/content", responses={**_ERRORS, 200: {"content": {"video/mp4": {}}}},
            response_class=Response)
async def video_content(video_id: str, request: Request, variant: str = Query(default="video", max_length=64)) -> Any:
    """The MP4 (supports ``Range``). 409 until the job is ``completed``."""
    ctx = request.app.state.ctx
    if variant != "video":
        raise ApiError(400, "unsupported_parameter", f"variant {variant!r} is not available; only 'video'",
                       param="variant")
    record = _get_record(ctx, video_id, request)
    status = record["status"]
    if status in ("queued", "in_progress"):
        raise ApiError(409, "job_not_ready", f"video {video_id} is {status}; its content is not ready yet")
    if status in ("failed", "cancelled"):
        raise ApiError(409, f"job_{status}", f"video {video_id} is {status}; it has no content")
    expires = record.get("expires_at")
    path = ctx.store.get_result_path(video_id)
    if (expires and expires < time.time()) or path is None or not path.exists():
        raise ApiError(404, "content_expired", f"the content of video {video_id} has expired")
    return RangeFileResponse(path, media_type="video/mp4", filename=f"{video_id}.mp4")  # bad Range: full 200


@router.get("/v1/videos/{video_id}/events", responses={**_ERRORS, 200: {"content": {"text/event-stream": {}}}},
            response_class=Response)
async def video_events(video_id: str, request: Request) -> Any:
    """Server-sent events: a snapshot, then progress per step and phase, heartbeats, and a terminal event.

    A client reconnecting with ``Last-Event-ID`` gets the events it missed when they are still buffered,
    otherwise a fresh snapshot; either way ids keep increasing.
    """
    ctx = request.app.state.ctx
    last_id = _last_event_id(request)
    if not _visible(ctx, request, video_id):
        raise ApiError(404, "job_not_found", f"no video job {video_id!r}", param="video_id")
    sub = ctx.hub.subscribe(video_id)  # before the snapshot, so nothing falls between the two
    record = ctx.store.get(video_id)
    if record is not None:
        record = _overlay(ctx, record)
    if record is None:
        sub.close()
        raise ApiError(404, "job_not_found", f"no video job {video_id!r}", param="video_id")
    tick_s = ctx.settings.heartbeat_interval_s

    def held_by_drain() -> bool:  # a queued job that a draining server will not run: end the stream
        return ctx.readiness.state == "draining" and (ctx.jobs is None or ctx.jobs.get_live(video_id) is None)

    async def stream() -> AsyncIterator[bytes]:
        try:
            snap = _with_position(ctx, record)
            if snap["status"] in TERMINAL:
                yield encode_event(ctx.hub.next_id(video_id, last_id), f"video.{snap['status']}", snap)
                return
            missed = ctx.hub.since(video_id, last_id) if last_id and not is_shared(ctx) else None
            if missed is None:
                sent = ctx.hub.next_id(video_id, last_id)
                yield encode_event(sent, "video.progress", {"id": video_id, **{k: snap.get(k) for k in PROGRESS_KEYS}})
            else:
                sent = last_id
                for ev in missed:
                    yield ev.encode()
                    sent = ev.id
            if is_shared(ctx):  # the job may run on any replica: follow its row (server/replica.py)
                async for chunk in poll_events(ctx, video_id, snap, sent, _overlay):
                    yield chunk
                return
            idle = 0.0
            while True:
                ev = await sub.get(timeout=tick_s)
                if ev is None:  # quiet: re-read the store now and then (the job may be gone or done)
                    idle += tick_s
                    if held_by_drain():
                        return
                    if idle < 3 * tick_s:
                        continue
                    idle, now = 0.0, ctx.store.get(video_id)
                    if now is None:
                        return
                    now = _overlay(ctx, now)
                    if now["status"] in TERMINAL:
                        yield encode_event(ctx.hub.next_id(video_id), f"video.{now['status']}", now)
                        return
                    continue
                idle = 0.0
                if ev.id <= sent:  # already replayed from the buffer
                    continue
                yield ev.encode()
                sent = ev.id
                if ev.type in ("video.completed", "video.failed", "video.cancelled"):
                    return
        finally:
            sub.close()

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _last_event_id(request: Request) -> int:
    text = request.headers.get("last-event-id", "").strip()
    return int(text) if text.isdigit() and len(text) < 19 else 0


async def _cancel_and_wait(ctx: ServerContext, video_id: str, reason: str) -> bool:
    """Cancel an active job and wait up to ``--cancel-wait`` for the worker; ``True`` once it stopped."""
    jobs = ctx.jobs
    live = jobs.get_live(video_id) if jobs is not None else None
    if live is None and is_shared(ctx):  # queued in the shared store, or running on another replica
        return await cancel_remote(ctx, video_id, reason)
    if jobs is None or live is None or live.done.is_set():
        return True
    jobs.cancel(video_id, reason=reason)
    return await jobs.wait(live, ctx.settings.cancel_wait_s)


_NOT_YET_STOPPED = "the worker did not acknowledge within --cancel-wait; the job stops at its next step"


@router.post("/v1/videos/{video_id}/cancel", response_model=VideoJob,
             responses={**_ERRORS, 202: {"model": VideoJob, "description": _NOT_YET_STOPPED}})
async def cancel_video(video_id: str, request: Request) -> JSONResponse | dict[str, object]:
    """Stop the job at the next step boundary and keep its record (202 if it has not stopped in time)."""
    ctx = request.app.state.ctx
    record = _get_record(ctx, video_id, request)
    if record["status"] in TERMINAL:
        if record["status"] == "cancelled":
            return record  # idempotent
        raise ApiError(409, "job_already_finished", f"video {video_id} is already {record['status']}")
    stopped = await _cancel_and_wait(ctx, video_id, "client request (POST /cancel)")
    record = _get_record(ctx, video_id, request)
    return JSONResponse(record, status_code=200 if stopped else 202)


@router.delete("/v1/videos/{video_id}", response_model=VideoDeleted,
               responses={**_ERRORS, 202: {"model": VideoDeletePending, "description": _NOT_YET_STOPPED}})
async def delete_video(video_id: str, request: Request) -> JSONResponse | dict[str, object]:
    """Cancel (if active), then delete the record and its files. ``deleted: true`` only after the work stopped."""
    ctx = request.app.state.ctx
    record = _get_record(ctx, video_id, request)
    if record["status"] not in TERMINAL:
        stopped = await _cancel_and_wait(ctx, video_id, "client request (DELETE)")
        if not stopped:
            ctx.store.mark_delete_pending(video_id)  # completed by the job manager when the worker stops
            return JSONResponse({"id": video_id, "object": "video.deleted", "deleted": False,
                                 "job": _get_record(ctx, video_id, request)}, status_code=202)
    ctx.store.delete(video_id)
    ctx.hub.forget(video_id)
    return {"id": video_id, "object": "video.deleted", "deleted": True}


@router.post("/v1/videos/sync", responses={**_ERRORS, 200: {"content": {"video/mp4": {}}}},
             response_class=Response, openapi_extra=_BODY)
async def create_video_sync(request: Request) -> Any:
    """Generate and return the MP4 in one call (same queue; not persisted; disconnect = cancel)."""
    ctx = request.app.state.ctx
    jobs, served = ctx.require()
    dto, raw, _ = await _parse(request)
    served = ctx.served_for(dto.model)
    media = await anyio.to_thread.run_sync(video_media.decode, raw, served, ctx.settings)
    job_id = new_id("video")
    greq = video_request(dto, served, ctx.settings, request_id=job_id, media=media)
    principal = principal_of(request)
    live = LiveJob(id=job_id, kind="sync", task="video.generate", persisted=False, deadline_s=dto.timeout_s,
                   owner=principal.key_id if principal is not None else None, model=ctx.model_key(served))
    await anyio.to_thread.run_sync(jobs.submit, live, greq)
    if not await wait_or_disconnect(request, jobs, live):
        return Response(status_code=499)
    if live.status != "completed":
        raise job_failure(live, request.scope.get("state", {}).get("request_id", "-"))
    out = live.outputs[0]
    if out.fps is None:  # a one-frame clip from a model that stamps fps only on multi-frame output
        import attrs

        out = attrs.evolve(out, kind="video", fps=live.engine_job.request.params.fps)
    t0 = time.perf_counter()
    data = await anyio.to_thread.run_sync(out.to_bytes, "mp4")
    encode_s = time.perf_counter() - t0
    metrics = {k: float(v) for k, v in (live.engine_job.metrics or {}).items()
               if k.endswith("_s") and isinstance(v, (int, float))}
    metrics["encode_output_s"] = encode_s
    timing = ", ".join(f"{k[:-2]};dur={v * 1000:.1f}" for k, v in metrics.items())
    return Response(data, media_type="video/mp4", headers={
        "X-Omnicore-Job-Id": job_id, "X-Omnicore-Seed": str(out.seed), "Server-Timing": timing,
        "Content-Disposition": f'attachment; filename="{job_id}.mp4"'})
