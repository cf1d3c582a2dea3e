"""The built-in web page in a real browser (Debian's headless Chromium driven by Selenium): a chat
message streams back and the engine view updates. The screenshot is kept in build/test-artifacts/."""
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
