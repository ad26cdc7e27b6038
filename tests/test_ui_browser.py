"""The web UI in a real browser: Debian's headless Chromium driven by Playwright against the server with the UI
mounted at /. Runs in CI (which installs chromium); locally it is skipped only when /usr/bin/chromium is absent."""
from __future__ import annotations

import os
import re
import time

import pytest
import torch

import dsv3lite
from dsv3lite.testing import paced
from dsv3lite.app.server import ServerThread, create_app

CHROMIUM = "/usr/bin/chromium"
MAX_TOKENS = 40
STATS_DONE = re.compile(r"decode\s+([0-9.]+) tok/s")


@pytest.fixture(scope="module")
def chromium_path():
    if not os.path.exists(CHROMIUM):
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM} is missing: CI must install Debian's chromium package")
        pytest.skip(f"{CHROMIUM} not installed (apt-get install -y chromium)")
    return CHROMIUM


@pytest.fixture(scope="module")
def served(v3_dir):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = dsv3lite.load(v3_dir, device="cpu", ctx_size=128, progress=False, log=lambda m: None)
    llm.stop_ids = set()                        # every reply runs to max_tokens
    llm.generate = paced(llm.generate, 0.025)  # <= 40 tok/s, so Stop lands mid-reply on any machine
    app = create_app(llm, ui=True, sampling={"max_tokens": MAX_TOKENS}, log=lambda m: None)
    with ServerThread(app) as server:
        yield server, app.state.runner
    torch.set_num_threads(before)


@pytest.fixture()
def page(chromium_path, tmp_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=chromium_path, headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run"])
        page = context.new_page()
        page.errors = []                                        # JavaScript exceptions on the page
        page.on("pageerror", lambda e: page.errors.append(str(e)))
        try:
            yield page
        finally:
            context.close()


def send(page, text: str) -> None:
    page.locator("#dsv3lite-input textarea").fill(text)
    page.locator("#dsv3lite-send").click()


def bot_text(page) -> str:
    bots = page.locator("#dsv3lite-chat .bot")
    return bots.last.inner_text() if bots.count() else ""


def test_chat_streams_stops_and_shows_stats(page, served, tmp_path):
    server, runner = served
    page.goto(server.url + "/")
    page.locator("#dsv3lite-input textarea").wait_for(timeout=60_000)
    assert "no reply yet" in page.locator("#dsv3lite-stats").inner_text().lower()

    # a reply that is stopped halfway: the engine stops generating and serves the next message
    send(page, "Tell me a long story")
    page.wait_for_function("() => { const b = document.querySelectorAll('#dsv3lite-chat .bot');"
                           " return b.length && b[b.length - 1].innerText.trim().length > 0; }", timeout=60_000)
    page.locator("#dsv3lite-stop").click()
    deadline = time.monotonic() + 20
    while runner.counters["cancelled"] < 1:
        assert time.monotonic() < deadline, "Stop did not cancel the generation"
        time.sleep(0.05)
    assert 0 < runner.counters["completion_tokens"] < MAX_TOKENS

    # a full reply: streamed text, then the stats panel shows this reply's figures and the routing heat map
    send(page, "Hello there")
    page.wait_for_function(
        "() => /reply\\s+%d tok/.test(document.querySelector('#dsv3lite-stats').innerText)" % MAX_TOKENS,
        timeout=60_000)
    stats = page.locator("#dsv3lite-stats").inner_text()
    assert float(STATS_DONE.search(stats).group(1)) > 0
    assert re.search(r"prefill\s+[0-9.]+ tok/s", stats) and "TTFT" in stats
    assert runner.counters["completed"] >= 1
    assert runner.last_stats["generated_tokens"] == MAX_TOKENS
    assert bot_text(page).strip()
    user_turns = page.locator("#dsv3lite-chat .user").all_inner_texts()
    assert [t.strip() for t in user_turns] == ["Tell me a long story", "Hello there"]
    assert page.locator("#dsv3lite-chart svg image").count() >= 1          # layer x expert heat map
    page.screenshot(path=str(tmp_path / "ui.png"), full_page=True)
    assert (tmp_path / "ui.png").stat().st_size > 0
    assert page.errors == []
