// Same-origin calls to the public API. The key (when the server wants one) lives in sessionStorage and travels only
// in the Authorization header; content endpoints are fetched as blobs for the same reason (no key in any URL).

const KEY = "omnicore.apiKey";

export const auth = {
  required: document.querySelector('meta[name="omnicore-auth"]')?.content === "required",
  get key() { return sessionStorage.getItem(KEY) || ""; },
  set key(value) { if (value) sessionStorage.setItem(KEY, value); else sessionStorage.removeItem(KEY); },
};

/** An error response in the server's shape: {"error": {"message", "type", "param", "code"}}. */
export class ApiError extends Error {
  constructor(status, body) {
    const err = (body && body.error) || {};
    super(err.message || `HTTP ${status}`);
    this.status = status;
    this.param = err.param || null;
    this.code = err.code || null;
  }
}

function headers(extra = {}) {
  const h = { ...extra };
  if (auth.key) h.Authorization = `Bearer ${auth.key}`;
  return h;
}

/** fetch() with the key; a non-2xx answer becomes an ApiError carrying the field the server named. */
export async function request(method, path, { json, form, signal, extraHeaders } = {}) {
  const init = { method, headers: headers(extraHeaders), signal, cache: "no-store" };
  if (json !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(json);
  } else if (form) {
    init.body = form;
  }
  const resp = await fetch(path, init);
  if (!resp.ok) throw new ApiError(resp.status, await resp.json().catch(() => null));
  return resp;
}

/** JSON.parse that keeps big seeds exact: a seed above 2**53 stays a string instead of being rounded. */
export function parseJson(text) {
  return JSON.parse(text.replace(/"seed":\s*(\d{16,})/g, '"seed":"$1"'));
}

export async function getJson(path) {
  return parseJson(await (await request("GET", path)).text());
}

/** A blob: URL for a protected binary (the caller revokes it when the element goes away). */
export async function blobUrl(path) {
  const resp = await request("GET", path);
  return URL.createObjectURL(await resp.blob());
}

/** Parse a text/event-stream body into {id, event, data} objects (fetch, not EventSource: it sends headers). */
export async function* readEvents(resp) {
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buf += value.replace(/\r\n/g, "\n");
      let end;
      while ((end = buf.indexOf("\n\n")) >= 0) {
        const block = buf.slice(0, end);
        buf = buf.slice(end + 2);
        const ev = { id: null, event: "message", data: "" };
        for (const line of block.split("\n")) {
          const colon = line.indexOf(":");
          if (colon <= 0) continue;
          const name = line.slice(0, colon);
          const text = line.slice(colon + 1).replace(/^ /, "");
          if (name === "data") ev.data += (ev.data ? "\n" : "") + text;
          else ev[name] = text;
        }
        if (!ev.data) continue;
        try { ev.data = parseJson(ev.data); } catch { /* keep the text */ }
        yield ev;
      }
    }
  } finally {
    reader.cancel().catch(() => {});  // the consumer stopped early: close the connection
  }
}
