// The playground's controller: key prompt, model card -> form, submit, live progress over SSE, cancel, gallery and
// the stored job list. Every call goes to this origin's public API (see api.js); nothing is fetched from elsewhere.

import { ApiError, auth, blobUrl, getJson, parseJson, readEvents, request } from "./api.js";
import { GenerationForm, el } from "./form.js";

const $ = (id) => document.getElementById(id);
const TERMINAL = new Set(["completed", "failed", "cancelled"]);

const state = { form: null, current: null, urls: [] };

function setStatus(text, ok) {
  const node = $("server-status");
  node.textContent = text;
  node.className = `status ${ok === undefined ? "" : ok ? "ok" : "bad"}`;
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// ------------------------------------------------------------------------------------------------ start and key

async function start() {
  $("auth-form").addEventListener("submit", onKey);
  $("forget-key").addEventListener("click", () => { auth.key = ""; location.reload(); });
  $("gen").addEventListener("submit", onSubmit);
  $("gen").addEventListener("reset", () => setTimeout(() => state.form && state.form.update(), 0));
  $("cancel").addEventListener("click", onCancel);
  $("jobs-refresh").addEventListener("click", () => refreshJobs());
  if (auth.required && !auth.key) { askForKey(); return; }
  await boot();
}

function askForKey(message = "") {
  $("app").hidden = true;
  $("auth").hidden = false;
  $("forget-key").hidden = true;
  $("auth-error").textContent = message;
  setStatus("API key required", false);
  $("api-key").focus();
}

async function onKey(event) {
  event.preventDefault();
  auth.key = $("api-key").value.trim();
  $("api-key").value = "";
  await boot();
}

async function waitReady() {
  for (;;) {
    const resp = await fetch("/health", { cache: "no-store" }).catch(() => null);
    const body = resp ? await resp.json().catch(() => ({})) : {};
    if (resp && resp.ok) return body;
    setStatus(body.status === "loading" ? "loading the model…" : body.error ? `unhealthy: ${body.error}`
      : `server ${body.status || "unreachable"}; retrying…`, false);
    await sleep(1000);
  }
}

async function boot() {
  let cards;
  try {
    const health = await waitReady();
    cards = (await getJson("/v1/models")).data;
    setStatus(`${health.model} ready on ${health.backend || "?"}`, true);
  } catch (err) {
    if (err instanceof ApiError && err.status === 401) { auth.key = ""; askForKey("That key was not accepted."); return; }
    setStatus(`could not load the model card: ${err.message}`, false);
    return;
  }
  $("auth").hidden = true;
  $("app").hidden = false;
  $("forget-key").hidden = !auth.required;
  state.form = new GenerationForm($("gen-fields"), cards);
  await refreshJobs();
}

// ------------------------------------------------------------------------------------------------ submit

async function onSubmit(event) {
  event.preventDefault();
  const form = state.form;
  form.clearErrors();
  $("form-error").textContent = "";
  const req = form.build();
  $("submit").disabled = true;
  try {
    if (req.output === "image") await runImage(req);
    else await runVideo(req);
  } catch (err) {
    showRequestError(err, req.files);
  } finally {
    $("submit").disabled = false;
  }
}

function showRequestError(err, files = []) {
  if (err.name === "AbortError") return;
  if (err instanceof ApiError && err.status === 401) { auth.key = ""; askForKey("The server no longer accepts the key."); return; }
  const shown = err instanceof ApiError && state.form.showError(err.param, err.message, files);
  if (!shown) {
    $("form-error").textContent = err.message;
    $("submit").focus();
  }
}

// ------------------------------------------------------------------------------------------------ progress

function resetRun(label, cancellable) {
  $("run").hidden = false;
  $("run-job").textContent = label;
  $("run-bar").value = 0;
  for (const id of ["run-phase", "run-step", "run-eta", "run-status"]) $(id).textContent = "–";
  $("run-error").textContent = "";
  $("cancel").hidden = !cancellable;
  $("cancel").disabled = false;
}

function formatEta(seconds) {
  if (!Number.isFinite(seconds) || seconds < 0) return "–";
  if (seconds < 60) return `${Math.round(seconds)} s`;
  return `${Math.floor(seconds / 60)} min ${Math.round(seconds % 60)} s`;
}

/** Track step timing so the ETA is (steps left) x (mean time per step seen so far). */
class Timer {
  constructor() { this.first = null; }
  eta(step, total) {
    if (!total || step == null) return NaN;
    const now = performance.now() / 1000;
    if (this.first === null || step < this.first.step) { this.first = { step, t: now }; return NaN; }
    const done = step - this.first.step;
    if (done <= 0) return NaN;
    return ((now - this.first.t) / done) * (total - step);
  }
}

function showProgress(data, timer) {
  if (data.progress != null) $("run-bar").value = data.progress;
  if (data.phase) $("run-phase").textContent = data.phase;
  if (data.total_steps) $("run-step").textContent = `${data.step ?? 0}/${data.total_steps}`;
  if (data.status) $("run-status").textContent = data.status.replace("_", " ");
  if (data.phase === "denoise" && data.total_steps) $("run-eta").textContent = formatEta(timer.eta(data.step, data.total_steps));
  else if (data.phase && data.phase !== "denoise" && data.phase !== "queued" && data.step === data.total_steps) $("run-eta").textContent = "finishing";
}

// ------------------------------------------------------------------------------------------------ videos

async function runVideo(req) {
  const job = parseJson(await (await request("POST", req.path, { form: req.form })).text());
  await follow(job);
}

/** Stream a video job's events until it ends (reconnecting with Last-Event-ID), then show its result. */
async function follow(job) {
  const controller = new AbortController();
  state.current = { id: job.id, controller };
  resetRun(`${job.id} — ${job.prompt || ""}`, !TERMINAL.has(job.status));
  const timer = new Timer();
  showProgress(job, timer);
  let record = job;
  let lastId = null;
  refreshJobs();
  try {
    while (!TERMINAL.has(record.status)) {
      let ended = false;
      try {
        const resp = await request("GET", `/v1/videos/${job.id}/events`, {
          signal: controller.signal, extraHeaders: lastId ? { "Last-Event-ID": lastId } : {} });
        for await (const ev of readEvents(resp)) {
          lastId = ev.id || lastId;
          if (ev.event === "video.heartbeat") continue;
          record = { ...record, ...ev.data };
          showProgress(ev.data, timer);
          if (TERMINAL.has(ev.data.status)) { ended = true; break; }
        }
      } catch (err) {
        if (err.name === "AbortError") throw err;
        if (err instanceof ApiError && err.status === 404) { record = { ...record, status: "cancelled", deleted: true }; break; }
      }
      if (!ended) {  // the stream closed early (restart, drain): look again, then reconnect
        await sleep(1000);
        try { record = { ...record, ...(await getJson(`/v1/videos/${job.id}`)) }; } catch (err) {
          if (err instanceof ApiError && err.status === 404) { record = { ...record, status: "cancelled", deleted: true }; break; }
        }
      }
    }
  } catch (err) {
    if (err.name === "AbortError") return;
    throw err;
  } finally {
    if (state.current && state.current.id === job.id) state.current = null;
  }
  finish(record);
  refreshJobs();
}

function finish(record) {
  $("cancel").hidden = true;
  $("run-status").textContent = record.deleted ? "cancelled (deleted)" : record.status.replace("_", " ");
  if (record.status === "completed") {
    $("run-bar").value = 100;
    $("run-eta").textContent = "done";
    addVideo(record);
  } else if (record.error) {
    $("run-error").textContent = `${record.error.code}: ${record.error.message}`;
  }
}

function addToGallery(item) {
  $("gallery-empty").hidden = true;
  $("gallery-items").prepend(item);
}

async function addVideo(record) {
  const path = `/v1/videos/${record.id}/content`;
  const video = el("video", { controls: true, playsinline: true, preload: "auto", "aria-label": `video ${record.id}` });
  const link = el("a", { download: `${record.id}.mp4`, text: "Download MP4" });
  const caption = el("p", { text: `${record.prompt || ""} · ${record.size} · ${record.num_frames ?? "?"} frames · seed ${record.seed ?? "?"}` });
  const item = el("li", { dataset: { job: record.id } }, video, caption, el("p", {}, link));
  addToGallery(item);
  try {
    const src = auth.key ? await blobUrl(path) : path;  // with a key: fetched with the header, never in the URL
    if (auth.key) state.urls.push(src);
    video.src = src;
    link.href = src;
  } catch (err) {
    caption.textContent = `could not load the video: ${err.message}`;
  }
}

async function onCancel() {
  const current = state.current;
  if (!current) return;
  $("cancel").disabled = true;
  $("run-status").textContent = "cancelling…";
  try {
    if (current.image) { current.controller.abort(); $("run-status").textContent = "cancelled"; $("cancel").hidden = true; return; }
    const resp = await request("DELETE", `/v1/videos/${current.id}`);
    const body = await resp.json();
    if (!body.deleted) $("run-status").textContent = "cancel requested; stopping at the next step";
  } catch (err) {
    $("run-error").textContent = err.message;
    $("cancel").disabled = false;
  }
}

// ------------------------------------------------------------------------------------------------ images

async function runImage(req) {
  const controller = new AbortController();
  state.current = { id: "image", image: true, controller };
  resetRun(`image — ${req.body ? req.body.prompt : req.form.get("prompt")}`, true);
  const timer = new Timer();
  try {
    const resp = await request("POST", req.path, req.body ? { json: req.body, signal: controller.signal }
      : { form: req.form, signal: controller.signal });
    for await (const ev of readEvents(resp)) {
      if (ev.event.endsWith(".progress")) showProgress(ev.data, timer);
      else if (ev.event.endsWith(".completed")) addImage(ev.data);
      else if (ev.event === "error") throw new ApiError(500, ev.data);
    }
    $("run-bar").value = 100;
    $("run-status").textContent = "completed";
    $("run-eta").textContent = "done";
  } catch (err) {
    if (err.name === "AbortError") return;
    $("run").hidden = !(err instanceof ApiError && err.status >= 500);
    throw err;
  } finally {
    $("cancel").hidden = true;
    state.current = null;
  }
}

function addImage(data) {
  const bytes = Uint8Array.from(atob(data.b64_json), (c) => c.charCodeAt(0));
  const src = URL.createObjectURL(new Blob([bytes], { type: `image/${data.output_format || "png"}` }));
  state.urls.push(src);
  const img = el("img", { src, alt: `generated image, seed ${data.seed}` });
  const link = el("a", { href: src, download: `omnicore-${data.seed}.${data.output_format || "png"}`, text: "Download" });
  addToGallery(el("li", {}, img, el("p", { text: `${data.size} · seed ${data.seed}` }), el("p", {}, link)));
}

// ------------------------------------------------------------------------------------------------ job list

async function refreshJobs() {
  let list;
  try {
    list = await getJson("/v1/videos?limit=20");
  } catch (err) {
    if (err instanceof ApiError && err.status === 401) { auth.key = ""; askForKey("The server no longer accepts the key."); }
    return;
  }
  const ul = $("jobs-list");
  ul.replaceChildren(...list.data.map(jobItem));
  $("jobs-empty").hidden = list.data.length > 0;
}

function jobItem(job) {
  const when = new Date(job.created_at * 1000).toLocaleString();
  const open = el("button", { type: "button", class: "secondary", "aria-label": `Open job ${job.id}`, text: "Open" });
  open.addEventListener("click", () => openJob(job.id));
  return el("li", { dataset: { job: job.id, status: job.status } },
    el("span", { class: "prompt", title: job.prompt || "" }, el("span", { class: `badge ${job.status}`, text: job.status.replace("_", " ") }), " ", job.prompt || job.id),
    el("span", { class: "meta", text: `${job.size} · ${job.num_frames ?? "?"} frames · ${when}` }),
    open);
}

async function openJob(id) {
  try {
    const record = await getJson(`/v1/videos/${id}`);
    if (state.current && !state.current.image && state.current.id !== id) state.current.controller.abort();
    if (TERMINAL.has(record.status)) {
      resetRun(`${record.id} — ${record.prompt || ""}`, false);
      showProgress(record, new Timer());
      finish(record);
    } else {
      await follow(record);
    }
  } catch (err) {
    $("run").hidden = false;
    $("run-error").textContent = err.message;
  }
}

window.addEventListener("pagehide", () => { for (const url of state.urls) URL.revokeObjectURL(url); });
start().catch((err) => setStatus(`playground error: ${err.message}`, false));
