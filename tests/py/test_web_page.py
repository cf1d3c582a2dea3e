"""The built-in web page in a real browser (Debian's headless Chromium driven by Selenium): a chat
message streams back and the engine view updates, JSON mode, tool calls. The screenshots are kept in
build/test-artifacts/."""
import json
import pathlib
import time

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from conftest import ROOT, cached_model
from server_util import Server

ARTIFACTS = ROOT / "build" / "test-artifacts"


@pytest.fixture(scope="module")
def browser():
    opts = webdriver.ChromeOptions()
    for arg in ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"]:
        opts.add_argument(arg)
    opts.binary_location = "/usr/bin/chromium"
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
    yield driver
    driver.quit()


def test_chat_streams_and_engine_view_updates(browser):
    server = Server(cached_model("qwen2.5-coder-0.5b-instruct"), name="qwen2.5-coder-0.5b-instruct")
    try:
        browser.get(server.url + "/")
        wait = WebDriverWait(browser, 60)
        wait.until(lambda d: d.find_element(By.ID, "model").text == "qwen2.5-coder-0.5b-instruct")
        polls_before = int(browser.find_element(By.TAG_NAME, "body").get_attribute("data-polls") or 0)
        # The map is redrawn twice a second: read it in one script call.
        classes = browser.execute_script("return [...document.querySelectorAll('#blocks i')].map(e => e.className)")
        assert len(classes) > 0 and set(classes) <= set("fucs")
        browser.find_element(By.ID, "prompt").send_keys("What is the capital of France? Answer in one word.")
        browser.find_element(By.ID, "send").click()
        reply = wait.until(lambda d: d.find_element(By.ID, "last-reply"))
        wait.until(lambda d: reply.get_attribute("data-finish"))
        text = reply.find_element(By.TAG_NAME, "span").text
        assert "Paris" in text
        assert "TTFT" in browser.find_element(By.ID, "speed").text
        # The engine view kept polling and now shows cached blocks and a TTFT sample.
        wait.until(lambda d: int(d.find_element(By.TAG_NAME, "body").get_attribute("data-polls")) > polls_before + 2)
        wait.until(lambda d: d.find_element(By.ID, "ttftlast").text.endswith("ms"))
        wait.until(lambda d: d.execute_script("return document.querySelectorAll('#blocks i.c, #blocks i.u').length > 0"))
        assert browser.find_element(By.ID, "spec").text == "off"
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(ARTIFACTS / "web-page.png"))
        assert (ARTIFACTS / "web-page.png").stat().st_size > 10000
    finally:
        assert server.stop() == 0


def test_speculative_server_shows_accepted_tokens_per_step(browser):
    server = Server(cached_model("qwen2.5-coder-0.5b-instruct"), "--spec", "ngram",
                    name="qwen2.5-coder-0.5b-instruct")
    try:
        browser.get(server.url + "/")
        wait = WebDriverWait(browser, 60)
        wait.until(lambda d: d.find_element(By.ID, "spec").text == "ngram, no guesses yet")
        browser.find_element(By.ID, "prompt").send_keys(
            "Repeat this line exactly three times: the quick brown fox jumps over the lazy dog")
        browser.find_element(By.ID, "send").click()
        reply = wait.until(lambda d: d.find_element(By.ID, "last-reply"))
        wait.until(lambda d: reply.get_attribute("data-finish"))
        # "1.85 (ngram, 62% of guesses)": tokens per verification step, then the share of guesses kept.
        wait.until(lambda d: "(ngram," in d.find_element(By.ID, "spec").text)
        per_step = float(browser.find_element(By.ID, "spec").text.split()[0])
        assert per_step > 1.0
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(ARTIFACTS / "web-page-speculative.png"))
    finally:
        assert server.stop() == 0


# Wraps the page's fetch: the body of every chat request is kept in window.sentBodies, and when
# arguments[0] is a list of chunks the chat endpoint answers them as a server-sent event stream.
WRAP_FETCH = """
const chunks = arguments[0];
const realFetch = window.fetch.bind(window);
window.sentBodies = [];
window.fetch = (url, opts) => {
  if (url !== '/v1/chat/completions') return realFetch(url, opts);
  window.sentBodies.push(opts.body);
  if (!chunks) return realFetch(url, opts);
  const sse = chunks.map(c => 'data: ' + JSON.stringify(c) + '\\n\\n').join('') + 'data: [DONE]\\n\\n';
  return Promise.resolve(new Response(sse, {headers: {'Content-Type': 'text/event-stream'}}));
};
"""


def open_page(browser, server):
    browser.get(server.url + "/")
    wait = WebDriverWait(browser, 120)
    wait.until(lambda d: d.find_element(By.ID, "model").text == "qwen2.5-coder-0.5b-instruct")
    return wait


def send_and_wait(browser, wait, prompt):
    browser.find_element(By.ID, "prompt").send_keys(prompt)
    browser.find_element(By.ID, "send").click()
    reply = wait.until(lambda d: d.find_element(By.ID, "last-reply"))
    wait.until(lambda d: reply.get_attribute("data-done"))
    return reply


def test_json_mode_reply_is_shown_as_json(browser):
    server = Server(cached_model("qwen2.5-coder-0.5b-instruct"), name="qwen2.5-coder-0.5b-instruct")
    try:
        wait = open_page(browser, server)
        browser.execute_script(WRAP_FETCH, None)
        browser.find_element(By.ID, "json").click()
        for field, value in (("max", "200"), ("temp", "0")):
            browser.find_element(By.ID, field).clear()
            browser.find_element(By.ID, field).send_keys(value)
        reply = send_and_wait(browser, wait, "Describe Paris with its name, country and population.")
        sent = json.loads(browser.execute_script("return window.sentBodies[0]"))
        assert sent["response_format"] == {"type": "json_object"} and "tools" not in sent
        text = reply.find_element(By.TAG_NAME, "span").text
        assert isinstance(json.loads(text), dict), text
        assert reply.get_attribute("data-json") == "ok"
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(ARTIFACTS / "web-page-json-mode.png"))
    finally:
        assert server.stop() == 0


def test_streamed_tool_calls_show_as_boxes(browser):
    """The chat endpoint is replaced in the page by canned chunks in OpenAI's streaming shape (the
    arguments in fragments, the two calls interleaved), so only the page's handling is under test."""
    def chunk(delta, finish=None):
        return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    def call(index, arguments, **first):
        fn = {"arguments": arguments, **({"name": first["name"]} if first else {})}
        return {"index": index, **({"id": first["id"], "type": "function"} if first else {}), "function": fn}

    chunks = [chunk({"role": "assistant", "content": "Checking."}),
              chunk({"tool_calls": [call(0, "", id="call_a", name="get_weather")]}),
              chunk({"tool_calls": [call(0, '{"city": ')]}),
              chunk({"tool_calls": [call(1, '{"city"', id="call_b", name="get_time")]}),
              chunk({"tool_calls": [call(0, '"Paris"}')]}),
              chunk({"tool_calls": [call(1, ': "Oslo"}')]}),
              chunk({}, "tool_calls")]
    tools = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
             for name in ("get_weather", "get_time")]
    server = Server(cached_model("qwen2.5-coder-0.5b-instruct"), name="qwen2.5-coder-0.5b-instruct")
    try:
        wait = open_page(browser, server)
        browser.execute_script(WRAP_FETCH, chunks)
        assert not browser.find_element(By.ID, "tools").is_displayed()  # collapsed until opened
        browser.find_element(By.CSS_SELECTOR, "#tools-box summary").click()
        browser.find_element(By.ID, "tools").send_keys(json.dumps(tools))
        reply = send_and_wait(browser, wait, "Weather in Paris and time in Oslo?")
        assert reply.get_attribute("data-finish") == "tool_calls"
        assert reply.find_element(By.TAG_NAME, "span").text == "Checking."
        boxes = [e.text for e in reply.find_elements(By.CLASS_NAME, "tool")]
        assert boxes == ['\U0001F527 get_weather({"city": "Paris"})', '\U0001F527 get_time({"city": "Oslo"})']
        assert json.loads(browser.execute_script("return window.sentBodies[0]"))["tools"] == tools
        # The calls go back in the history of the next request, as the assistant's message.
        send_and_wait(browser, wait, "Thanks")
        history = json.loads(browser.execute_script("return window.sentBodies[1]"))["messages"]
        assert [c["function"] for c in history[1]["tool_calls"]] == [
            {"name": "get_weather", "arguments": '{"city": "Paris"}'}, {"name": "get_time", "arguments": '{"city": "Oslo"}'}]
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(ARTIFACTS / "web-page-tool-calls.png"))
    finally:
        assert server.stop() == 0
