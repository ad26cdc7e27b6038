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
def browser(chromium_path, tmp_path):
    """browser(width, height) -> a new page of headless Chromium at that viewport."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=chromium_path, headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run"])

        def new_page(width: int = 1280, height: int = 900):
            page = context.new_page()
            page.set_viewport_size({"width": width, "height": height})
            page.errors = []                                        # JavaScript exceptions on the page
            page.on("pageerror", lambda e: page.errors.append(str(e)))
            return page
        try:
            yield new_page
        finally:
            context.close()


@pytest.fixture()
def page(browser):
    return browser()


def open_ui(page, server) -> None:
    page.goto(server.url + "/")
    page.locator("#dsv3lite-input textarea").wait_for(timeout=60_000)


def send(page, text: str) -> None:
    page.locator("#dsv3lite-input textarea").fill(text)
    page.locator("#dsv3lite-send").click()


def bot_text(page) -> str:
    bots = page.locator("#dsv3lite-chat .bot")
    return bots.last.inner_text() if bots.count() else ""


def wait_for_reply(page, finish: str) -> None:
    """Until the stats panel shows this page's reply ended with `finish` (length | stop | stopped)."""
    page.wait_for_function(r"f => new RegExp('reply\\s+\\d+ tok \\(' + f + '\\)')"
                           r".test(document.querySelector('#dsv3lite-stats').innerText)", arg=finish, timeout=60_000)


def no_error_badge(page) -> bool:
    return page.locator("#dsv3lite-chat .error").count() == 0 and "Error" not in page.locator(
        "#dsv3lite-chat").inner_text()


def test_chat_streams_stops_and_shows_stats(page, served, tmp_path):
    server, runner = served
    # an API request first: a fresh page shows no stats of it (the panel is this page's own)
    import httpx
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert r.status_code == 200 and runner.last_stats.get("generated_tokens") == 3
    open_ui(page, server)
    assert "no reply yet" in page.locator("#dsv3lite-stats").inner_text().lower()
    assert page.locator("#dsv3lite-stop").is_disabled()                    # nothing to stop yet

    # a reply that is stopped halfway: the engine stops generating and serves the next message
    send(page, "Tell me a long story")
    page.wait_for_function("() => { const b = document.querySelectorAll('#dsv3lite-chat .bot');"
                           " return b.length && b[b.length - 1].innerText.trim().length > 0; }", timeout=60_000)
    page.locator("#dsv3lite-stop").click()
    wait_for_reply(page, "stopped")
    assert runner.counters["cancelled"] >= 1
    assert 0 < runner.last_stats["generated_tokens"] < MAX_TOKENS
    assert bot_text(page).strip().endswith("[stopped]")
    assert page.locator("#dsv3lite-stop").is_disabled()

    # a full reply: streamed text, then the stats panel shows this reply's figures and the routing heat map
    send(page, "Hello there")
    wait_for_reply(page, "length")
    stats = page.locator("#dsv3lite-stats").inner_text()
    assert re.search(r"reply\s+%d tok" % MAX_TOKENS, stats)
    assert float(STATS_DONE.search(stats).group(1)) > 0
    assert re.search(r"prefill\s+[0-9.]+ tok/s", stats) and "TTFT" in stats
    assert runner.counters["completed"] >= 1
    assert runner.last_stats["generated_tokens"] == MAX_TOKENS
    assert bot_text(page).strip() and "[stopped]" not in bot_text(page)
    user_turns = page.locator("#dsv3lite-chat .user").all_inner_texts()
    assert [t.strip() for t in user_turns] == ["Tell me a long story", "Hello there"]
    assert page.locator("#dsv3lite-chart svg image").count() >= 1          # layer x expert heat map
    page.screenshot(path=str(tmp_path / "ui.png"), full_page=True)
    assert (tmp_path / "ui.png").stat().st_size > 0
    assert page.errors == []


def test_stop_right_after_send_keeps_the_chat(page, served):
    """Stop ~150 ms after sending, Settings open: no error badge, the history stays, the reply is marked."""
    server, runner = served
    open_ui(page, server)
    send(page, "Good morrow")
    wait_for_reply(page, "length")
    first_reply = bot_text(page)
    page.locator("#dsv3lite-settings").get_by_text("Settings").click()
    page.locator("#dsv3lite-settings input[type=checkbox]").wait_for()      # the panel is open
    cancelled = runner.counters["cancelled"]
    send(page, "Tell me a long story")
    time.sleep(0.15)
    page.locator("#dsv3lite-stop").click()                 # (waits until Stop is enabled, i.e. the reply started)
    wait_for_reply(page, "stopped")
    assert no_error_badge(page)
    assert [t.strip() for t in page.locator("#dsv3lite-chat .user").all_inner_texts()] == \
        ["Good morrow", "Tell me a long story"]
    bots = page.locator("#dsv3lite-chat .bot").all_inner_texts()
    assert bots[0] == first_reply and bots[-1].strip().endswith("[stopped]")
    assert runner.counters["cancelled"] == cancelled + 1
    time.sleep(0.5)                                        # nothing arrives later to replace the chat
    assert no_error_badge(page) and bot_text(page).strip().endswith("[stopped]")
    assert page.errors == []


def test_phone_width_layout(browser, served):
    """At 420 px the input box spans the chat column and nothing sticks out sideways."""
    server, _ = served
    page = browser(420, 860)
    open_ui(page, server)
    chat = page.locator("#dsv3lite-chat").bounding_box()
    box = page.locator("#dsv3lite-input textarea").bounding_box()
    assert box["width"] >= 0.85 * chat["width"], (box, chat)
    for button in ("send", "stop", "clear"):
        b = page.locator(f"#dsv3lite-{button}").bounding_box()
        assert b["x"] >= 0 and b["x"] + b["width"] <= 420 and b["width"] >= 60, (button, b)
    assert page.evaluate("document.scrollingElement.scrollWidth") <= 420
    assert page.errors == []


def test_v4_checkpoint_in_the_web_ui(page, v4_dir):
    """A released-layout DeepSeek-V4 checkpoint behind the UI: a reply streams to its end, the stats panel shows
    its figures and the routing heat map of its layers (the MTP block's included)."""
    llm = dsv3lite.load(v4_dir, device="cpu", ctx_size=128, progress=False, log=lambda m: None)
    llm.stop_ids = set()
    app = create_app(llm, ui=True, sampling={"max_tokens": 12}, log=lambda m: None)
    with ServerThread(app) as server:
        open_ui(page, server)
        send(page, "Hello there")
        wait_for_reply(page, "length")
        stats = page.locator("#dsv3lite-stats").inner_text()
        assert re.search(r"reply\s+12 tok", stats) and float(STATS_DONE.search(stats).group(1)) > 0
        assert bot_text(page).strip() and no_error_badge(page)
        assert page.locator("#dsv3lite-chart svg image").count() >= 1
        assert app.state.runner.last_stats["mtp"]["enabled"] is True
        assert page.errors == []
