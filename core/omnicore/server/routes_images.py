"""``POST /v1/images/generations`` (JSON) and ``POST /v1/images/edits`` (multipart)

Image requests are synchronous but go through the same job manager and queue as videos (429 when full),
and a client that disconnects cancels its work.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from ..ids import new_id
from ..outputs.options import EncodeOptions
from .errors import ApiError, pydantic_to_api
from .forms import is_json, read_json, read_multipart
from .jobs import LiveJob
from .media import decode_data_url, decode_images
from .progress import api_phase, phase_fraction, weighted_progress
from .schemas import ErrorResponse, ImageEditFields, ImageGenerationRequest, ImagesResponse, inline_schema
from .sse import encode_event
from .translate import image_request

if TYPE_CHECKING:
    from ..engine.progress import ProgressEvent
    from ..engine.request import GenerationRequest
    from ..outputs.output import Output
    from .jobs import JobManager

router = APIRouter(tags=["images"])
_ERRORS: dict[int | str, dict[str, object]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 408, 409, 413, 415, 429, 500, 503, 504)}


def encode_images(outputs: list[Output], fmt: str, compression: int | None) -> list[str]:
    """Encode outputs as base64 ``fmt`` (CPU work: call from a thread)."""
    from ..outputs.writers import encode_output

    options = EncodeOptions(image_quality=max(1, compression)) if compression is not None else EncodeOptions()
    return [base64.b64encode(encode_output(out, fmt, options)).decode("ascii") for out in outputs]


async def wait_or_disconnect(request: Request, jobs: JobManager, live: LiveJob, poll_s: float = 0.25) -> bool:
    """Await the job; if the client goes away first, cancel it and return ``False``."""
    waiter = asyncio.ensure_future(jobs.wait(live))
    try:
        while True:
            done, _ = await asyncio.wait({waiter}, timeout=poll_s)
            if done:
                return True
            if await request.is_disconnected():
                jobs.cancel(live.id, reason="client disconnect")
                return False
    finally:
        if not waiter.done():
            waiter.cancel()


def job_failure(live: LiveJob, request_id: str) -> ApiError:
    """A synchronous job that ended without outputs, as an HTTP error."""
    if live.error_code == "cancelled":
        return ApiError(409, "job_cancelled", f"the request was cancelled ({live.cancel_reason})")
    if live.error_code == "timeout":  # the client's own deadline (timeout_s): not a server fault, so not 5xx
        return ApiError(409, "timeout", f"the request exceeded its timeout_s ({live.deadline_s:g} s) and was stopped")
    if live.error_code == "server_timeout":  # the operator's --max-job-seconds: the server's doing, not the client's
        return ApiError(504, "server_timeout", "the request ran longer than this server allows (--max-job-seconds, "
                                               f"counting running time) and was stopped; request id {request_id}")
    detail = f"{type(live.error).__name__}: {live.error}" if live.error is not None else "unknown error"
    if live.error_code == "out_of_memory":
        detail = f"out of memory in phase {live.phase or 'unknown'}: {detail}"
    return ApiError(500, live.error_code or "internal_error", f"generation failed ({detail}); request id {request_id}")


async def _run(request: Request, dto: ImageGenerationRequest, images: tuple[object, ...],
               task: str) -> Response | dict[str, object]:
    ctx = request.app.state.ctx
    jobs, served = ctx.require()
    served = ctx.served_for(dto.model)  # (several models: the one `model` names)
    job_id = new_id("img")
    greq = image_request(dto, served, ctx.settings, request_id=job_id, images=images, task=task)
    principal = request.scope.get("state", {}).get("principal")
    live = LiveJob(id=job_id, kind="image", task=task, persisted=False, deadline_s=dto.timeout_s,
                   owner=principal.key_id if principal is not None else None, model=ctx.model_key(served))
    if dto.stream:
        return await _stream(request, dto, live, greq, task)
    await anyio.to_thread.run_sync(jobs.submit, live, greq)
    if not await wait_or_disconnect(request, jobs, live):
        return JSONResponse({"error": {"message": "client disconnected", "type": "invalid_request_error",
                                       "param": None, "code": "client_disconnected"}}, status_code=499)
    if live.status != "completed":
        raise job_failure(live, request.scope.get("state", {}).get("request_id", "-"))
    t0 = time.perf_counter()
    b64 = await anyio.to_thread.run_sync(encode_images, live.outputs, dto.output_format, dto.output_compression)
    encode_s = time.perf_counter() - t0
    ctx.metrics.stage.labels(stage="encode_output").observe(encode_s)
    first = live.outputs[0]
    timings = jobs.timings(live, live.engine_job, time.time(), encode_s)  # the same keys as a video job's
    return {
        "id": job_id, "created": int(live.created), "model": served.id, "size": f"{first.width}x{first.height}",
        "output_format": dto.output_format,
        "data": [{"b64_json": b, "revised_prompt": o.text, "seed": o.seed} for b, o in zip(b64, live.outputs)],
        "timings": timings,
    }


async def _stream(request: Request, dto: ImageGenerationRequest, live: LiveJob, greq: GenerationRequest,
                  task: str) -> StreamingResponse:
    """``stream: true``: progress events, then one ``completed`` event per image."""
    ctx = request.app.state.ctx
    jobs, served = ctx.require()
    prefix = "image_edit" if task == "image.edit" else "image_generation"
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[ProgressEvent] = asyncio.Queue()

    def on_event(ev: ProgressEvent) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, ev)

    live.on_event = on_event  # registered before submission: a fast job cannot finish before we listen
    await anyio.to_thread.run_sync(jobs.submit, live, greq)

    async def events() -> AsyncIterator[bytes]:
        n = progress = 0
        try:
            while True:
                ev = await queue.get()
                n += 1
                if ev.terminal:
                    break
                phase = api_phase(ev.phase)
                fraction = phase_fraction(phase, ev.step, ev.total_steps)
                progress = max(progress, weighted_progress(phase, fraction))
                yield encode_event(n, f"{prefix}.progress", {
                    "status": "queued" if phase == "queued" else "in_progress", "phase": phase,
                    "phase_progress": fraction, "step": ev.step, "total_steps": ev.total_steps,
                    "progress": progress, "updated_at": int(time.time())})
            await jobs.wait(live)
            if live.status != "completed":
                err = job_failure(live, "-")
                yield encode_event(n + 1, "error", err.body())
                return
            b64 = await anyio.to_thread.run_sync(encode_images, live.outputs, dto.output_format,
                                                 dto.output_compression)
            for i, (b, out) in enumerate(zip(b64, live.outputs)):
                yield encode_event(n + 1 + i, f"{prefix}.completed", {
                    "b64_json": b, "index": i, "seed": out.seed, "size": f"{out.width}x{out.height}",
                    "revised_prompt": out.text,
                    "output_format": dto.output_format, "created_at": int(time.time())})
        finally:
            if not live.done.is_set():
                jobs.cancel(live.id, reason="client disconnect")

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


_GENERATIONS_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": inline_schema(ImageGenerationRequest)}}}}


@router.post("/v1/images/generations", response_model=ImagesResponse, responses=_ERRORS,
             openapi_extra=_GENERATIONS_BODY)
async def generations(request: Request) -> Response | dict[str, object]:  # (response_model: ImagesResponse)
    """Generate images from a prompt (OpenAI Images API shape). JSON only: another body type is a 415."""
    if not is_json(request):
        raise ApiError(415, "unsupported_media_type", "images/generations takes an application/json body")
    try:
        body = ImageGenerationRequest.model_validate(await read_json(request))
    except ValidationError as exc:
        raise pydantic_to_api(exc) from None
    return await _run(request, body, (), "image.generate")


_EDIT_SCHEMA = {
    "requestBody": {
        "required": True,
        "content": {"multipart/form-data": {"schema": {
            "type": "object", "required": ["prompt", "image"],
            "properties": {
                "prompt": {"type": "string", "minLength": 1},
                "image": {"type": "string", "format": "binary"},
                "n": {"type": "integer", "minimum": 1, "maximum": 10},
                "size": {"type": "string"},
                "output_format": {"type": "string", "enum": ["png", "jpeg", "webp"]},
                "num_inference_steps": {"type": "integer", "minimum": 1, "maximum": 200},
                "guidance_scale": {"type": "number", "minimum": 0, "maximum": 20},
                "seed": {"type": "integer", "minimum": 0},
                "negative_prompt": {"type": "string"},
            },
        }}},
    },
}


@router.post("/v1/images/edits", response_model=ImagesResponse, responses=_ERRORS, openapi_extra=_EDIT_SCHEMA)
async def edits(request: Request) -> Response | dict[str, object]:  # (response_model: ImagesResponse)
    """Edit or condition on input images (multipart; ``image``/``image[]`` files or ``image_url`` data URLs)."""
    ctx = request.app.state.ctx
    ctx.readiness.require_ready()
    if ctx.pool is None and "image.edit" not in ctx.served.tasks:
        raise ApiError(404, "task_not_supported", f"model {ctx.served.id} does not serve image.edit "
                                                  f"(it serves: {', '.join(ctx.served.tasks) or 'nothing'})")
    if not request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
        raise ApiError(415, "unsupported_media_type", "images/edits takes multipart/form-data")
    fields, files = await read_multipart(request, max_upload_bytes=ctx.settings.max_upload_bytes,
                                         file_fields=("image", "mask"))
    served = ctx.served_for(fields.get("model") if isinstance(fields.get("model"), str) else None)
    if "image.edit" not in served.tasks:
        raise ApiError(404, "task_not_supported", f"model {served.id} does not serve image.edit "
                                                  f"(it serves: {', '.join(served.tasks) or 'nothing'})")
    files_images = files.get("image", [])
    if "mask" in files:
        raise ApiError(400, "unsupported_for_model", f"model {served.id} does not support inpainting masks",
                       param="mask")
    try:
        dto = ImageEditFields.model_validate(fields)
    except ValidationError as exc:
        raise pydantic_to_api(exc) from None
    raw = list(files_images) + [decode_data_url(u, param="image_url") for u in (dto.image_url or [])]
    if not raw:
        raise ApiError(400, "missing_required_parameter", "images/edits needs at least one image", param="image")
    if len(raw) > max(1, served.max_reference_images) and "image.edit" in served.tasks:
        raise ApiError(400, "too_many_input_images", f"{len(raw)} input images; model {served.id} accepts at "
                                                     f"most {served.max_reference_images}", param="image")
    # headers first, then the decoded size within --max-decode-bytes (400/429), then the pixels
    images = tuple(await anyio.to_thread.run_sync(lambda: decode_images(raw, param="image", settings=ctx.settings)))
    dto_plain = ImageGenerationRequest.model_validate(dto.model_dump(exclude={"image_url"}, exclude_unset=True))
    return await _run(request, dto_plain, images, "image.edit")
