"""The web console: GET /snapshot (its fields, that they move with the engine, its auth), the
page and its assets (served from the package, without a key), and the page in a real headless
Chromium: log in, chat with streamed tokens, watch the live view while a long generation runs,
stop it and see the server's running count drop to 0, a wrong key refused."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import httpx
import pytest

from anna.server.app import create_app
from conftest import engine_settings, launch_server, stop_server

KEY = "console-key-1"


async def _get_all(app, requests: list[tuple[str, str, dict]]) -> list[httpx.Response]:
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return [await client.request(method, path, **kw) for method, path, kw in requests]


def test_snapshot_fields_move_with_the_engine_and_need_the_key(qwen2_dir, cache_dir):
    app = create_app(engine_settings(qwen2_dir, cache_dir, api_key=KEY, inference_warmup=False),
                     load_in_background=False)
    auth = {"headers": {"Authorization": f"Bearer {KEY}"}}
    chat = {"model": str(qwen2_dir), "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
            "ignore_eos": True}
    before, refused, page, script, _, after, wrong = asyncio.run(_get_all(app, [
        ("GET", "/snapshot", auth), ("GET", "/snapshot", {}), ("GET", "/", {}), ("GET", "/console/console.js", {}),
        ("POST", "/v1/chat/completions", {**auth, "json": chat}), ("GET", "/snapshot", auth),
        ("GET", "/snapshot", {"headers": {"Authorization": "Bearer nope"}})]))
    assert refused.status_code == 401 and wrong.status_code == 401
    assert page.status_code == 200 and "text/html" in page.headers["content-type"] and 'id="messages"' in page.text
    assert script.status_code == 200 and "/snapshot" in script.text
    a, b = before.json(), after.json()
    assert set(a) >= {"time", "model", "requests", "tokens", "kv_cache", "prefix_cache", "prompt_cache", "steps",
                      "memory", "settings"}
    assert b["time"] > a["time"] and b["tokens"]["generation"] - a["tokens"]["generation"] == 5
    assert b["requests"]["finished"] == a["requests"]["finished"] + 1 and b["requests"]["running"] == 0
    assert b["steps"]["total"] > a["steps"]["total"] and b["steps"]["classes"]["pure"]["mean_ms"] > 0
    assert b["kv_cache"]["blocks"] == 256 and b["kv_cache"]["used"] == 0
    settings = {s["name"]: s for s in b["settings"]}
    assert settings["api_key"]["value"] == "<set>" and settings["num_gpu_blocks_override"]["source"] == "cli"
    assert settings["block_size"]["source"] == "default"


def test_no_web_ui_leaves_the_root_a_404(qwen2_dir, cache_dir):
    app = create_app(engine_settings(qwen2_dir, cache_dir, web_ui=False, inference_warmup=False),
                     load_in_background=False)
    root, snapshot = asyncio.run(_get_all(app, [("GET", "/", {}), ("GET", "/snapshot", {})]))
    assert root.status_code == 404 and snapshot.status_code == 200  # scripts still read the snapshot


def chrome():
    """Headless Chromium under Selenium, or a skip that says what is missing."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    binary = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    driver = shutil.which("chromedriver")
    if binary is None or driver is None:
        pytest.skip("no Chromium and chromedriver on this machine (Debian: apt-get install chromium chromium-driver)")
    options = Options()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1360,860"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=options)


@pytest.fixture(scope="module")
def endless_qwen2_dir(roomy_qwen2_dir, tmp_path_factory) -> Path:
    """The roomy tiny Qwen2 whose EOS id is one its 800 logits never reach: a generation ends only
    at max_tokens or when stopped, so that Stop is what the browser test sees end it. (Such an id
    serves no grammar, so the server that loads it runs without the warmup's constrained request.)"""
    path = tmp_path_factory.mktemp("endless") / "qwen2"
    shutil.copytree(roomy_qwen2_dir, path)
    (path / "generation_config.json").write_text('{"eos_token_id": 100000}')
    return path


def test_the_console_in_a_real_browser(endless_qwen2_dir, cache_dir, tmp_path, request):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser = chrome()
    # a template that opens <think> in the prompt: the random model never closes it, so every
    # answer is reasoning, which the page must show apart from the (empty) answer
    template = Path(__file__).parent / "data" / "qwen3_5_style_chat_template.jinja"
    proc, base = launch_server(endless_qwen2_dir, cache_dir, tmp_path / "server.log", "--api-key", KEY,
                               "--max-model-len", "16384", "--num-gpu-blocks-override", "1100",
                               "--served-model-name", "tiny-console", "--chat-template", str(template),
                               "--no-inference-warmup")
    shots = request.config.getoption("--console-screenshots")

    def snapshot() -> dict:
        return httpx.get(base + "/snapshot", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()

    def shot(name: str) -> None:
        browser.save_screenshot(str(tmp_path / name))
        if shots:
            shutil.copy(tmp_path / name, f"{shots}/{name}")

    wait = WebDriverWait(browser, 60, poll_frequency=0.1)
    by_id = lambda name: browser.find_element(By.ID, name)  # noqa: E731
    try:
        browser.get(base + "/")
        wait.until(lambda _: "API key needed" in by_id("status").text)
        by_id("api-key").send_keys("wrong-key")
        by_id("login").submit()
        wait.until(lambda _: "API key refused" in by_id("status").text)
        by_id("api-key").clear()
        by_id("api-key").send_keys(KEY)
        by_id("login").submit()
        wait.until(lambda _: by_id("status").text.startswith("live"))
        assert by_id("model").text == "tiny-console"

        # a short answer, streamed, with its figures and its reasoning apart
        for name, value in (("max_tokens", "48"), ("seed", "3"), ("system", "You are terse.")):
            by_id(name).clear()
            by_id(name).send_keys(value)
        by_id("prompt").send_keys("Hello there")
        by_id("send").click()
        last = lambda: browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]  # noqa: E731
        wait.until(lambda _: "TTFT" in last().find_element(By.CLASS_NAME, "figures").text)
        figures = last().find_element(By.CLASS_NAME, "figures").text
        assert "tokens/s" in figures and "prompt tokens cached" in figures
        reasoning = last().find_element(By.CLASS_NAME, "reasoning")
        assert reasoning.is_displayed() and reasoning.find_element(By.CLASS_NAME, "reasoning-text").text
        assert last().find_element(By.CLASS_NAME, "answer").text == ""
        shot("console-chat.png")

        # a long generation: tokens appear while it runs, the live view moves, Stop aborts it
        by_id("max_tokens").clear()
        by_id("max_tokens").send_keys("16000")
        by_id("prompt").send_keys("Now a very long story, please.")
        by_id("send").click()
        wait.until(lambda _: len(last().find_element(By.CLASS_NAME, "reasoning-text").text) > 20)
        assert by_id("stop").is_enabled()  # still streaming: the text came before the end
        assert snapshot()["requests"]["running"] == 1
        by_id("tab-engine").click()
        wait.until(lambda _: by_id("running").text == "1" and float(by_id("rate-out").text or 0) > 0)
        chart = lambda: browser.execute_script("return document.getElementById('chart-tokens').toDataURL()")  # noqa: E731
        first = chart()
        time.sleep(1.5)
        assert chart() != first and by_id("running").text == "1"
        assert int(by_id("kv").text.split(" / ")[0]) > 0  # the running request holds blocks
        assert by_id("settings").find_elements(By.TAG_NAME, "tr")
        shot("console-engine.png")
        by_id("tab-chat").click()
        by_id("stop").click()
        deadline = time.monotonic() + 30
        while snapshot()["requests"]["running"] != 0:
            assert time.monotonic() < deadline, "the stopped request still runs on the server"
            time.sleep(0.1)
        assert snapshot()["requests"]["aborted"] >= 1
        wait.until(lambda _: "stopped" in last().find_element(By.CLASS_NAME, "figures").text)
        by_id("tab-engine").click()
        wait.until(lambda _: by_id("running").text == "0")
    finally:
        browser.quit()
        stop_server(proc)
