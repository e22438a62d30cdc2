// The generation form, built from the model card (GET /v1/models): modes, limits and defaults, one file input per
// declared input role, the model's own request fields (model_params), quality and seed. An empty field means "the
// model's default" (shown as the placeholder), so the server and the model stay the only authority on values.

/** Tiny DOM builder: el("input", {type: "text"}, child, ...). */
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "text") node.textContent = v;
    else if (k === "dataset") Object.assign(node.dataset, v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children) if (c !== null && c !== undefined) node.append(c);
  return node;
}

/** The HTTP field of /v1/videos for a file of `kind` in `role` (null: the route has none). */
export function videoField(role, kind) {
  if (role === "first_frame" && kind === "image") return "input_reference";
  if (role === "last_frame" && kind === "image") return "last_frame";
  if (role === "reference") return { image: "reference_images", video: "reference_video", audio: "reference_audio" }[kind];
  return null;
}

const VIDEO_FIELD_ORDER = ["input_reference", "last_frame", "reference_images", "reference_video", "reference_audio"];
const ROLE_LABELS = { first_frame: "First frame", last_frame: "Last frame", reference: "References", edit_source: "Image to edit" };

export function kindOfFile(file) {
  const t = (file.type || "").split("/")[0];
  return ["image", "video", "audio"].includes(t) ? t : "image";
}

/** "t2v", "ti2v", "t2va", "fl2va" make videos; "t2i", "i2i", "edit" make images. */
export function outputOfMode(mode) {
  return /2i$|^edit$/.test(mode) ? "image" : "video";
}

let uid = 0;

function field(param, labelText, control, { hint, wide, check } = {}) {
  const id = control.id || `f${++uid}`;
  control.id = id;
  control.dataset.param = param;
  const err = el("p", { class: "field-error", id: `${id}-error`, role: "alert" });
  const described = [err.id];
  let hintNode = null;
  if (hint) {
    hintNode = el("p", { class: "hint", id: `${id}-hint`, text: hint });
    described.unshift(hintNode.id);
  }
  control.setAttribute("aria-describedby", described.join(" "));
  const label = el("label", { for: id, text: labelText });
  const box = el("div", { class: `field${wide ? " wide" : ""}${check ? " check" : ""}`, dataset: { field: param } });
  if (check) box.append(control, label); else box.append(label, control);
  if (hintNode) box.append(hintNode);
  box.append(err);
  return box;
}

function numberInput(name, { min, max, step = 1, placeholder } = {}) {
  return el("input", { type: "number", name, min, max, step, placeholder, inputmode: "numeric" });
}

export class GenerationForm {
  /** `root`: the container for the fields; `cards`: the data of GET /v1/models. */
  constructor(root, cards) {
    this.root = root;
    this.cards = cards;
    this.render(cards[0]);
  }

  get card() { return this.cards.find((c) => c.id === this.modelSelect.value) || this.cards[0]; }
  get mode() { return this.modeSelect.value; }
  get output() { return outputOfMode(this.mode); }

  render(card) {
    const o = card.omnicore;
    this.root.replaceChildren();
    this.controls = new Map();  // param -> element that shows its error
    this.roleInputs = [];       // {role, input}

    this.modelSelect = el("select", { name: "model" }, ...this.cards.map((c) => el("option", { value: c.id, text: c.id })));
    this.modelSelect.value = card.id;
    this.modelSelect.addEventListener("change", () => this.render(this.card));
    const modes = o.modes.length ? o.modes : (o.tasks.includes("video.generate") ? ["t2v"] : ["t2i"]);
    this.modeSelect = el("select", { name: "mode" }, ...modes.map((m) => el("option", { value: m, text: m })));
    const firstVideo = modes.find((m) => outputOfMode(m) === "video");
    if (firstVideo && o.tasks.includes("video.generate")) this.modeSelect.value = firstVideo;
    this.modeSelect.addEventListener("change", () => this.update());

    const what = el("fieldset", {}, el("legend", { text: "Model" }), el("div", { class: "grid" },
      field("model", "Model", this.modelSelect, { hint: `${o.plugin}${o.backend ? ` on ${o.backend}` : ""}` }),
      field("mode", "Mode", this.modeSelect, { hint: "what goes in and what comes out" })));

    const prompt = el("textarea", { name: "prompt", id: "prompt", required: true, rows: 3,
                                    placeholder: "a red fox running through fresh snow" });
    const negative = el("textarea", { name: "negative_prompt", rows: 2, placeholder: "optional" });
    const text = el("fieldset", {}, el("legend", { text: "Prompt" }),
      field("prompt", "Prompt", prompt, { wide: true }),
      field("negative_prompt", "Negative prompt", negative, { wide: true }));

    const sizes = o.sizes || {};
    const limits = [sizes.multiple_of ? `multiple of ${sizes.multiple_of}` : null,
                    sizes.max_pixels ? `at most ${sizes.max_pixels.toLocaleString("en")} pixels` : null].filter(Boolean);
    const size = el("input", { type: "text", name: "size", placeholder: sizes.default, pattern: "\\d+x\\d+",
                               autocomplete: "off", spellcheck: "false" });
    const steps = numberInput("num_inference_steps", { min: 1, max: o.max_steps || 200,
                                                       placeholder: o.defaults.num_inference_steps });
    const v = o.video || {};
    const frames = numberInput("num_frames", { min: 1, max: v.max_frames, placeholder: v.default_frames });
    const seconds = numberInput("seconds", { min: 1, max: 3600, placeholder: "from frames" });
    const fpsRange = v.fps_range;
    const fps = numberInput("fps", { min: fpsRange ? fpsRange[0] : 1, max: fpsRange ? fpsRange[1] : 240,
                                     placeholder: v.default_fps });
    const frameHint = [v.frame_rule ? `rule ${v.frame_rule}` : null, v.max_frames ? `max ${v.max_frames}` : null,
                       `default ${v.default_frames}`].filter(Boolean).join(", ");
    const shape = el("fieldset", {}, el("legend", { text: "Size and length" }), el("div", { class: "grid" },
      field("size", "Size (WxH)", size, { hint: `default ${sizes.default}${limits.length ? `; ${limits.join(", ")}` : ""}` }),
      field("num_inference_steps", "Steps", steps, { hint: `default ${o.defaults.num_inference_steps}${o.max_steps ? `, max ${o.max_steps}` : ""}` }),
      this.videoOnly(field("num_frames", "Frames", frames, { hint: frameHint })),
      this.videoOnly(field("seconds", "Duration (s)", seconds, { hint: "whole seconds; frames win" })),
      this.videoOnly(field("fps", "FPS", fps, { hint: fpsRange ? `${fpsRange[0]}–${fpsRange[1]}, default ${v.default_fps}` : `default ${v.default_fps}` }))));
    if (v.audio) {
      const audio = el("input", { type: "checkbox", name: "generate_audio", checked: true });
      shape.append(this.videoOnly(field("generate_audio", "Generate audio", audio, { check: true })));
    }

    const inputs = el("fieldset", { id: "inputs" }, el("legend", { text: "Conditioning inputs" }));
    for (const r of o.inputs.roles || []) {
      const accept = r.kinds.map((k) => `${k}/*`).join(",");
      const input = el("input", { type: "file", name: `role:${r.role}`, accept, multiple: r.max_count > 1 });
      input.dataset.role = r.role;
      input.dataset.kinds = r.kinds.join(",");
      input.dataset.max = r.max_count;
      const dur = r.max_duration_s ? `, up to ${r.max_duration_s} s` : "";
      const hint = `${r.kinds.join(" / ")}, up to ${r.max_count}${dur}${r.description ? ` — ${r.description}` : ""}`;
      inputs.append(field(`role:${r.role}`, ROLE_LABELS[r.role] || r.role, input, { hint, wide: true }));
      this.roleInputs.push({ role: r.role, input });
    }
    if (!this.roleInputs.length) inputs.hidden = true;

    const extras = el("fieldset", { id: "model-params" }, el("legend", { text: "Model options (this request)" }));
    const grid = el("div", { class: "grid" });
    for (const p of o.model_params || []) grid.append(this.paramField(p));
    extras.append(grid);
    if (!(o.model_params || []).length) extras.hidden = true;

    const quality = el("select", { name: "quality" },
      ...[["", "standard (default)"], ["draft", "draft"], ["standard", "standard"], ["high", "high"]]
        .map(([value, label]) => el("option", { value, text: label })));
    const seed = numberInput("seed", { min: 0, max: 2 ** 63 - 1,
                                       placeholder: o.defaults.seed ?? "random" });
    const tuning = el("fieldset", {}, el("legend", { text: "Quality and seed" }), el("div", { class: "grid" },
      field("quality", "Quality", quality, { hint: "draft is faster, high is the model's best" }),
      field("seed", "Seed", seed, { hint: o.defaults.seed != null ? `default ${o.defaults.seed}` : "empty: random" })));

    this.root.append(what, text, shape, inputs, extras, tuning);
    for (const node of this.root.querySelectorAll("[data-param]")) this.controls.set(node.dataset.param, node);
    this.update();
  }

  videoOnly(node) { node.dataset.output = "video"; return node; }

  paramField(p) {
    const param = `model_params.${p.name}`;
    let control;
    if (p.choices) {
      control = el("select", { name: param },
        el("option", { value: "", text: p.default != null ? `${p.default} (default)` : "(model decides)" }),
        ...p.choices.map((c) => el("option", { value: String(c), text: String(c) })));
    } else if (p.type === "bool") {
      control = el("input", { type: "checkbox", name: param, checked: p.default === true });
    } else if (p.type === "int" || p.type === "float") {
      control = el("input", { type: "number", name: param, step: p.type === "int" ? 1 : "any",
                              placeholder: p.default ?? "" });
    } else {
      control = el("input", { type: "text", name: param, placeholder: p.default ?? "" });
    }
    control.dataset.type = p.type;
    const required = p.required_for && p.required_for.length ? `required for ${p.required_for.join(", ")}` : "";
    const hint = [required, p.help].filter(Boolean).join(" — ");
    return field(param, p.name.replace(/_/g, " "), control, { hint, check: p.type === "bool" });
  }

  /** Show the fields the chosen mode uses (video-only fields and video inputs for video modes). */
  update() {
    const video = this.output === "video";
    for (const node of this.root.querySelectorAll('[data-output="video"]')) node.hidden = !video;
    const editable = this.card.omnicore.tasks.includes("image.edit");
    const inputs = this.root.querySelector("#inputs");
    if (inputs && this.roleInputs.length) {
      inputs.hidden = !video && !editable;
      for (const { role, input } of this.roleInputs) {
        const usable = video ? input.dataset.kinds.split(",").some((k) => videoField(role, k)) : editable;
        input.closest(".field").hidden = !usable;
      }
    }
  }

  clearErrors() {
    for (const node of this.root.querySelectorAll(".field-error")) node.textContent = "";
    for (const node of this.root.querySelectorAll("[aria-invalid]")) node.removeAttribute("aria-invalid");
  }

  /** Put the server's message next to the field it names; false when no field matches. */
  showError(param, message, sentFiles = []) {
    let target = param ? this.controls.get(param) : null;
    const m = param && /^inputs\[(\d+)\]/.exec(param);
    if (!target && m && sentFiles[Number(m[1])]) target = sentFiles[Number(m[1])].input;
    if (!target && param) {
      const byField = this.roleInputs.find(({ role, input }) =>
        input.dataset.kinds.split(",").some((k) => videoField(role, k) === param) || (param === "image" && role));
      if (byField) target = byField.input;
    }
    if (!target && param && param.startsWith("model_params.")) target = this.controls.get(param.split(".").slice(0, 2).join("."));
    if (!target) return false;
    target.setAttribute("aria-invalid", "true");
    const err = document.getElementById(`${target.id}-error`);
    err.textContent = message;
    target.closest(".field").hidden = false;
    target.focus();
    return true;
  }

  value(param) {
    const node = this.controls.get(param);
    if (!node || node.closest("[hidden]")) return undefined;
    if (node.type === "checkbox") return node.checked;
    const text = node.value.trim();
    return text === "" ? undefined : text;
  }

  /** The request to send: {output, path, body (JSON) or form (FormData), files: [{input}] in the order sent}. */
  build() {
    const fields = {};
    fields.model = this.card.id;
    for (const name of ["prompt", "negative_prompt", "size", "num_inference_steps", "seed", "quality"]) {
      const value = this.value(name);
      if (value !== undefined) fields[name] = value;
    }
    if (fields.prompt === undefined) fields.prompt = "";
    const params = {};
    for (const p of this.card.omnicore.model_params || []) {
      const node = this.controls.get(`model_params.${p.name}`);
      if (node.type === "checkbox") { if (node.checked !== (p.default === true)) params[p.name] = node.checked; continue; }
      const text = node.value.trim();
      if (text === "") continue;
      params[p.name] = p.type === "int" || p.type === "float" ? Number(text) : p.type === "bool" ? text === "true" : text;
    }
    const hasParams = Object.keys(params).length > 0;
    if (this.output === "image") {
      for (const name of ["num_inference_steps", "seed"]) if (fields[name] !== undefined) fields[name] = Number(fields[name]);
      const files = this.roleInputs.filter(({ input }) => !input.closest("[hidden]"))
        .flatMap(({ input }) => [...input.files].map((file) => ({ input, file })));
      if (!files.length) {
        const body = { ...fields, n: 1, stream: true };
        if (hasParams) body.model_params = params;
        return { output: "image", path: "/v1/images/generations", body, files: [] };
      }
      const form = new FormData();
      for (const [k, value] of Object.entries(fields)) form.append(k, value);
      form.append("stream", "true");
      if (hasParams) form.append("model_params", JSON.stringify(params));
      for (const { file } of files) form.append("image[]", file, file.name);
      return { output: "image", path: "/v1/images/edits", form, files };
    }
    for (const name of ["num_frames", "seconds", "fps"]) {
      const value = this.value(name);
      if (value !== undefined) fields[name] = value;
    }
    const audio = this.value("generate_audio");
    if (audio !== undefined) fields.generate_audio = audio ? "true" : "false";
    const form = new FormData();
    for (const [k, value] of Object.entries(fields)) form.append(k, value);
    if (hasParams) form.append("model_params", JSON.stringify(params));
    const byField = new Map(VIDEO_FIELD_ORDER.map((f) => [f, []]));
    for (const { role, input } of this.roleInputs) {
      for (const file of input.files) {
        const name = videoField(role, kindOfFile(file));
        if (name) byField.get(name).push({ input, file, field: name });
      }
    }
    const files = [];
    for (const f of VIDEO_FIELD_ORDER) {  // the server lists inputs in this order: inputs[i] is files[i]
      for (const item of byField.get(f)) { form.append(f, item.file, item.file.name); files.push(item); }
    }
    return { output: "video", path: "/v1/videos", form, files };
  }
}
