"""The browser playground (``omnicore serve`` at ``/``) in a real headless Chromium driven by Playwright.

The browser tests run against real ``omnicore serve`` processes (tiny:lingbot; tiny:minimax-h3 for audio and the
aspect-ratio field): submit through the form, watch the live progress, play the result, cancel a running job, see
the server's validation message next to the field it names, reload after a restart, and the key prompt with
``--api-key``. Chromium is Debian's package (``make test`` installs it when it can); Playwright's own browser
download is never used. Screenshots at desktop and phone widths land in this session's temporary directory;
``OMNICORE_UPDATE_SCREENSHOT=1`` also copies the desktop one to ``docs/playground.png`` (the README's picture).
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = Path(shutil.which("chromium") or "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--autoplay-policy=no-user-gesture-required"]
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
needs_browser = pytest.mark.skipif(not CHROMIUM.exists(), reason="no Chromium here (apt-get install chromium)")


# ------------------------------------------------------------------------------------- fast: routes, auth, wheel

def test_page_and_assets_are_served_open_and_no_ui_removes_them(make_server, client_for, tmp_path):
    srv = make_server(state_dir=tmp_path / "keyed", api_keys=("sekrit",))
    c = client_for(srv)
    page = c.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<meta name="omnicore-auth" content="required">' in page.text  # the page asks for the key first
    assert "script-src 'self'" in page.headers["content-security-policy"]
    for name in ("app.js", "api.js", "form.js", "style.css"):
        asset = c.get(f"/ui/{name}")
        assert asset.status_code == 200, name
    assert c.get("/ui/app.js").headers["content-type"].startswith("text/javascript")
    # the exact asset paths are open, nothing else is: data routes and unknown /ui paths still need the key
    for path in ("/v1/models", "/v1/videos", "/ui/nothing.js", "/ui/../routes_ui.py", "/docs"):
        assert c.get(path).status_code == 401, path
    keyed = client_for(srv, headers={"Authorization": "Bearer sekrit"})
    assert keyed.get("/ui/nothing.js").json()["error"]["code"] == "route_not_found"

    plain = client_for(make_server(state_dir=tmp_path / "plain"))
    assert '<meta name="omnicore-auth" content="none">' in plain.get("/").text
    off = client_for(make_server(state_dir=tmp_path / "off", no_ui=True))
    assert off.get("/").status_code == 404 and off.get("/ui/app.js").status_code == 404
    assert off.get("/health").status_code == 200


def test_no_ui_flag_reaches_the_server_settings():
    from omnicore.cli.main import build_parser
    from omnicore.config import flags_from_args, resolve_settings
    from omnicore.server.settings import server_settings_from

    args = build_parser().parse_args(["serve", "tiny:lingbot", "--no-ui"])
    settings = resolve_settings(flags_from_args(args, "global", "engine", "server"), env={})
    assert server_settings_from(settings).no_ui is True
    assert server_settings_from(resolve_settings({}, env={"OMNICORE_NO_UI": "1"})).no_ui is True
    assert server_settings_from(resolve_settings({}, env={})).no_ui is False


def test_the_wheel_ships_every_playground_file():
    """The package-data patterns of core/pyproject.toml cover each file under omnicore/server/ui."""
    from omnicore.server.routes_ui import ASSETS, UI_DIR

    text = (REPO / "core" / "pyproject.toml").read_text()
    section = text.split("[tool.setuptools.package-data]", 1)[1]
    patterns = ast.literal_eval(re.search(r"^omnicore = (\[.*?\])", section, re.M | re.S).group(1))
    package = UI_DIR.parents[1]
    shipped = {p for pat in patterns for p in package.glob(pat)}
    files = [p for p in UI_DIR.iterdir() if p.is_file()]
    assert files and set(files) <= shipped, sorted(str(p) for p in set(files) - shipped)
    assert {"index.html", "app.js", "api.js", "form.js", "style.css"} <= set(ASSETS)


def test_minimax_h3_card_declares_its_request_fields():
    """The form draws H3's aspect ratio from the card: the declaration and the rule's accepted values agree."""
    pytest.importorskip("omni_minimax_h3", reason="the MiniMax-H3 plugin is not installed")
    from omni_minimax_h3.plugin import MODEL_SPEC
    from omni_minimax_h3.request_rules import ASPECT_RATIOS
    from omnicore.server.translate import ServedModel

    card = ServedModel.from_spec(MODEL_SPEC).card()["omnicore"]
    fields = {f["name"]: f for f in card["model_params"]}
    assert fields["aspect_ratio"]["choices"] == list(ASPECT_RATIOS) and fields["aspect_ratio"]["type"] == "str"
    assert fields["task"]["choices"] == list(card["modes"])


# ------------------------------------------------------------------------------------- browser fixtures

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """``omnicore serve MODEL`` on a fixed port and state directory; ``restart()`` keeps both."""

    def __init__(self, model: str, state_dir: Path, cache_dir: Path, plugins: str, *args: str) -> None:
        self.model, self.state_dir, self.args = model, state_dir, args
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = dict(os.environ, OMNICORE_CACHE=str(cache_dir), OMNICORE_PLUGINS=plugins,
                        OMNICORE_SHUTDOWN_GRACE_S="5", OMNICORE_CANCEL_WAIT_S="20")
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> ServeProcess:
        exe = Path(sys.executable).with_name("omnicore")
        self.proc = subprocess.Popen([str(exe), "serve", self.model, "--port", str(self.port), "--storage-dir",
                                      str(self.state_dir), *self.args], env=self.env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 180
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"omnicore serve exited: {self.proc.stdout.read() if self.proc.stdout else ''}")
            assert time.monotonic() < deadline, "the server did not become ready"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.communicate()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("playground-cache")


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Screenshots of this run (their directory is printed by the test that writes them)."""
    return tmp_path_factory.mktemp("playground-screenshots")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.skip("no Chromium here (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def lingbot(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Iterator[ServeProcess]:
    pytest.importorskip("omni_lingbot", reason="the LingBot plugin (plugins/lingbot) is not installed")
    srv = ServeProcess("tiny:lingbot", tmp_path_factory.mktemp("lingbot-state"), cache_dir, "lingbot").start()
    yield srv
    srv.stop()


class Page:
    """A browser page with its console errors collected (each test asserts on them)."""

    def __init__(self, browser: Any, url: str, viewport: dict[str, int] = DESKTOP) -> None:
        self.context = browser.new_context(viewport=viewport)
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        self.page.goto(url)

    def close(self) -> None:
        self.context.close()

    def unexpected_errors(self, *allowed_statuses: int) -> list[str]:
        """Console errors, less the browser's own note about a deliberate HTTP error answer."""
        ok = tuple(f"status of {s}" for s in allowed_statuses)
        return [e for e in self.errors if not (e.startswith("Failed to load resource") and e.endswith(ok)
                                                 or any(o in e for o in ok))]


@pytest.fixture
def open_page(browser: Any) -> Iterator[Any]:
    pages: list[Page] = []

    def make(url: str, viewport: dict[str, int] = DESKTOP) -> Page:
        p = Page(browser, url, viewport)
        pages.append(p)
        return p

    yield make
    for p in pages:
        p.close()


def field(page: Any, param: str) -> Any:
    return page.locator(f'[data-param="{param}"]')


def field_error(page: Any, param: str) -> Any:
    return page.locator(f'[data-field="{param}"] .field-error')


RECORD_STEPS = """() => {
  window.__seen = {step: [], eta: [], phase: []};
  for (const [key, id] of [["step", "run-step"], ["eta", "run-eta"], ["phase", "run-phase"]]) {
    new MutationObserver((records) => {
      for (const r of records) for (const n of r.addedNodes) window.__seen[key].push(n.textContent);
    }).observe(document.getElementById(id), {childList: true});
  }
}"""

VIDEO_READY = "() => { const v = document.querySelector('#gallery-items video'); return v && v.readyState >= 2; }"


def wait_video_plays(page: Any) -> dict[str, Any]:
    page.wait_for_function(VIDEO_READY, timeout=90_000)
    page.evaluate("() => document.querySelector('#gallery-items video').play()")
    page.wait_for_function("() => { const v = document.querySelector('#gallery-items video');"
                           " return v.currentTime > 0 || v.ended; }", timeout=20_000)
    return page.evaluate("() => { const v = document.querySelector('#gallery-items video'); return {"
                         "ready: v.readyState, w: v.videoWidth, h: v.videoHeight, d: v.duration,"
                         "audio: v.webkitAudioDecodedByteCount}; }")


# ------------------------------------------------------------------------------------- browser tests

@needs_browser
@pytest.mark.slow
def test_text_to_video_by_keyboard_shows_progress_plays_and_fits_desktop_and_phone(lingbot, open_page, artifacts):
    p = open_page(lingbot.url + "/")
    page = p.page
    page.wait_for_selector("#app:not([hidden])")
    unlabeled = page.evaluate("() => [...document.querySelectorAll('#gen input, #gen select, #gen textarea')]"
                              ".filter((e) => !e.labels || e.labels.length === 0).map((e) => e.name)")
    assert unlabeled == []
    assert field(page, "mode").input_value() == "t2v"  # a video mode first for a video model
    # keyboard only: the skip link leads to the prompt, Tab walks the form to the Generate button
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.className") == "skip"
    page.keyboard.press("Enter")
    page.wait_for_function("() => document.activeElement && document.activeElement.id === 'prompt'")
    page.keyboard.type("a red fox running through fresh snow")
    field(page, "num_inference_steps").fill("6")
    field(page, "num_frames").fill("9")
    field(page, "size").fill("64x64")
    field(page, "prompt").focus()
    for _ in range(40):
        if page.evaluate("document.activeElement.id") == "submit":
            break
        page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.id") == "submit", "Generate is not reachable with Tab"
    page.evaluate(RECORD_STEPS)
    page.keyboard.press("Enter")

    info = wait_video_plays(page)
    assert info["ready"] >= 2 and (info["w"], info["h"]) == (64, 64), info
    seen = page.evaluate("window.__seen")
    steps = [int(s.split("/")[0]) for s in seen["step"] if s.endswith("/6")]
    assert steps and steps == sorted(steps) and steps[-1] == 6 and len(set(steps)) >= 2, seen
    assert "denoise" in seen["phase"], seen
    assert any(e.endswith(" s") for e in seen["eta"]) and seen["eta"][-1] == "done", seen
    assert page.locator("#run-status").inner_text() == "completed"
    link = page.locator("#gallery-items a[download]").first
    assert link.get_attribute("href").endswith("/content")  # no key on this server: the plain URL
    job = page.locator("#jobs-list li").first
    assert job.get_attribute("data-status") == "completed"
    assert "a red fox running" in job.inner_text()

    seed = httpx.get(f"{lingbot.url}/v1/videos/{job.get_attribute('data-job')}", timeout=10).json()["seed"]
    assert f"seed {seed}" in page.locator("#gallery-items li").first.inner_text()  # exact, even above 2**53
    page.evaluate("() => window.scrollTo(0, 0)")
    page.screenshot(path=str(artifacts / "playground-desktop.png"))
    assert page.evaluate("document.documentElement.scrollWidth") <= DESKTOP["width"]
    page.set_viewport_size(PHONE)
    page.wait_for_timeout(200)
    assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"], "horizontal scroll on a phone"
    assert page.locator("#submit").bounding_box()["width"] > 40
    page.screenshot(path=str(artifacts / "playground-phone.png"), full_page=True)
    print(f"playground screenshots: {artifacts}")
    if os.environ.get("OMNICORE_UPDATE_SCREENSHOT") == "1":
        shutil.copyfile(artifacts / "playground-desktop.png", REPO / "docs" / "playground.png")
    assert p.unexpected_errors() == []


@needs_browser
@pytest.mark.slow
def test_cancel_stops_a_running_job(lingbot, open_page):
    p = open_page(lingbot.url + "/")
    page = p.page
    page.wait_for_selector("#app:not([hidden])")
    field(page, "prompt").fill("a long one to cancel")
    field(page, "size").fill("192x192")
    field(page, "num_frames").fill("17")
    field(page, "num_inference_steps").fill("60")
    page.get_by_role("button", name="Generate").click()
    deadline = time.monotonic() + 60
    while not re.fullmatch(r"([2-9]|\d\d)/60", page.locator("#run-step").inner_text()):
        assert time.monotonic() < deadline, "no denoise step 2 within 60 s"
        page.wait_for_timeout(100)
    job_id = page.locator("#run-job").inner_text().split(" ")[0]
    page.get_by_role("button", name="Cancel").click()
    page.wait_for_function("() => document.getElementById('run-status').textContent.startsWith('cancelled')",
                           timeout=30_000)
    stopped_at = page.locator("#run-step").inner_text()
    assert int(stopped_at.split("/")[0]) < 60, stopped_at
    assert page.locator("#cancel").is_hidden()
    # the server agrees: nothing runs any more and the job is gone (DELETE cancels, then deletes)
    health = httpx.get(lingbot.url + "/health", timeout=10).json()
    assert health["running"] == 0 and health["queue_depth"] == 0, health
    assert httpx.get(f"{lingbot.url}/v1/videos/{job_id}", timeout=10).status_code == 404
    page.wait_for_timeout(500)
    assert page.locator("#run-step").inner_text() == stopped_at  # no progress after the stop
    assert p.unexpected_errors() == []


@needs_browser
@pytest.mark.slow
def test_a_bad_value_shows_the_servers_message_next_to_its_field(lingbot, open_page):
    p = open_page(lingbot.url + "/", PHONE)
    page = p.page
    page.wait_for_selector("#app:not([hidden])")
    field(page, "prompt").fill("a fox")
    field(page, "size").fill("50x50")
    page.get_by_role("button", name="Generate").click()
    error = field_error(page, "size")
    error.wait_for(state="visible", timeout=15_000)
    # the server's own words (translate.check_size), shown by the size field, which is marked and focused
    assert "size 50x50 is not a multiple of 16" in error.inner_text()
    assert field(page, "size").get_attribute("aria-invalid") == "true"
    assert page.evaluate("document.activeElement.dataset.param") == "size"
    assert page.locator("#form-error").inner_text() == "" and page.locator("#run").is_hidden()
    field(page, "size").fill("")
    field(page, "num_frames").fill("0")
    page.get_by_role("button", name="Generate").click()
    field_error(page, "num_frames").wait_for(state="visible", timeout=15_000)
    assert "num_frames" in field_error(page, "num_frames").inner_text()
    assert field_error(page, "size").inner_text() == ""  # the previous error was cleared
    assert p.unexpected_errors(400) == []


@needs_browser
@pytest.mark.slow
def test_reload_after_a_server_restart_shows_the_finished_job(lingbot, open_page):
    job = httpx.post(lingbot.url + "/v1/videos", json={"prompt": "survives a restart", "size": "48x48",
                                                       "num_frames": 5, "num_inference_steps": 2}, timeout=30).json()
    deadline = time.monotonic() + 60
    while httpx.get(f"{lingbot.url}/v1/videos/{job['id']}", timeout=10).json()["status"] != "completed":
        assert time.monotonic() < deadline
        time.sleep(0.3)
    p = open_page(lingbot.url + "/")
    page = p.page
    page.wait_for_selector(f'#jobs-list li[data-job="{job["id"]}"]')
    lingbot.restart()
    page.reload()
    item = page.locator(f'#jobs-list li[data-job="{job["id"]}"]')
    item.wait_for(timeout=30_000)
    assert item.get_attribute("data-status") == "completed" and "survives a restart" in item.inner_text()
    item.get_by_role("button").click()
    info = wait_video_plays(page)
    assert info["ready"] >= 2 and (info["w"], info["h"]) == (48, 48), info
    assert page.locator("#run-status").inner_text() == "completed"
    assert p.unexpected_errors() == []


@needs_browser
@pytest.mark.slow
def test_with_an_api_key_the_page_asks_for_it_and_shows_no_data_without_it(tmp_path, cache_dir, open_page):
    pytest.importorskip("omni_lingbot", reason="the LingBot plugin (plugins/lingbot) is not installed")
    srv = ServeProcess("tiny:lingbot", tmp_path / "state", cache_dir, "lingbot", "--api-key", "k-123").start()
    try:
        requests: list[str] = []
        p = open_page(srv.url + "/")
        page = p.page
        page.on("request", lambda r: requests.append(r.url))
        page.reload()
        page.locator("#auth").wait_for(state="visible")
        assert page.locator("#app").is_hidden() and page.locator("#jobs-list li").count() == 0
        assert page.get_by_label("API key", exact=True).is_visible()
        assert not [u for u in requests if "/v1/" in u], requests  # no data call without a key
        page.get_by_label("API key", exact=True).fill("wrong")
        page.get_by_role("button", name="Use key").click()
        page.locator("#auth-error").wait_for(state="visible")
        assert "not accepted" in page.locator("#auth-error").inner_text()
        page.get_by_label("API key", exact=True).fill("k-123")
        page.get_by_role("button", name="Use key").click()
        page.wait_for_selector("#app:not([hidden])")
        assert page.evaluate("sessionStorage.getItem('omnicore.apiKey')") == "k-123"
        field(page, "prompt").fill("with a key")
        field(page, "num_inference_steps").fill("2")
        page.get_by_role("button", name="Generate").click()
        info = wait_video_plays(page)
        assert info["ready"] >= 2
        src = page.evaluate("document.querySelector('#gallery-items video').src")
        assert src.startswith("blob:")  # fetched with the Authorization header
        assert not [u for u in requests if "k-123" in u], "the key appeared in a URL"
        assert p.unexpected_errors(401) == []
    finally:
        srv.stop()


@needs_browser
@pytest.mark.slow
def test_minimax_h3_aspect_ratio_field_and_video_with_audio(tmp_path, cache_dir, open_page):
    pytest.importorskip("omni_minimax_h3", reason="the MiniMax-H3 plugin is not installed")
    srv = ServeProcess("tiny:minimax-h3", tmp_path / "state", cache_dir, "minimax_h3").start()
    try:
        p = open_page(srv.url + "/")
        page = p.page
        page.wait_for_selector("#app:not([hidden])")
        ratio = field(page, "model_params.aspect_ratio")
        assert ratio.is_visible() and "16:9" in ratio.inner_text()
        assert field(page, "generate_audio").is_checked()
        field(page, "prompt").fill("waves on a beach")
        field(page, "num_inference_steps").fill("2")  # the tiny preset's default frames (107: H3's 4 s minimum)
        page.get_by_role("button", name="Generate").click()  # t2va without a ratio: the model says it is needed
        error = field_error(page, "model_params.aspect_ratio")
        error.wait_for(state="visible", timeout=30_000)
        assert "aspect_ratio" in error.inner_text() and "t2va" in error.inner_text()
        ratio.select_option("16:9")
        page.get_by_role("button", name="Generate").click()
        info = wait_video_plays(page)
        assert info["ready"] >= 2 and info["w"] > info["h"], info  # a 16:9 canvas
        page.wait_for_function("() => document.querySelector('#gallery-items video').webkitAudioDecodedByteCount > 0",
                               timeout=20_000)
        assert p.unexpected_errors(400) == []
    finally:
        srv.stop()
