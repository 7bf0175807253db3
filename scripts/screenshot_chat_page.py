"""The README's screenshots of the chat page (GET /): serves a model (SmolLM2 by default) on a
free port of 127.0.0.1, drives the page in Debian's headless Chromium with Selenium (keyboard
only), saves docs/images/chat_page.png (a short conversation with its TTFT and tokens/s) and
chat_page_json.png (a JSON-schema answer), then stops the server.

    .venv/bin/python scripts/screenshot_chat_page.py [--model smollm2] [--out docs/images]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.wait import WebDriverWait

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "maxLength": 20},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 24},
                      "minItems": 2, "maxItems": 3},
    },
    "required": ["city", "country", "landmarks"],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, port: int) -> subprocess.Popen:
    cli = Path(sys.executable).parent / "compiled-engine"
    proc = subprocess.Popen([str(cli), "serve", "--model", model, "--host", "127.0.0.1",
                             "--port", str(port)], cwd=ROOT)
    deadline = time.monotonic() + 900  # a first start compiles the graphs
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"serve exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop_server(proc)
            raise SystemExit("serve did not become healthy in time")
        time.sleep(1)


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def browser() -> WebDriver:
    os.environ["SE_OFFLINE"] = "true"  # no Selenium Manager downloads
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1100,800"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(executable_path=shutil.which("chromedriver")),
                            options=options)


def open_page(driver: WebDriver, url: str) -> None:
    driver.get(url)
    wait(driver, lambda: driver.find_element(By.ID, "model").text.startswith("model:"))


def fill(driver: WebDriver, element_id: str, text: str) -> None:
    field = driver.find_element(By.ID, element_id)
    field.send_keys(Keys.CONTROL, "a")
    field.send_keys(Keys.DELETE, text)


def wait(driver: WebDriver, condition: Callable[[], object], timeout_s: float = 120) -> None:
    WebDriverWait(driver, timeout_s, poll_frequency=0.1).until(lambda _: condition())


def say(driver: WebDriver, message: str) -> None:
    """Send a message (Enter) and wait for its answer's stats line."""
    before = len(driver.find_elements(By.CSS_SELECTOR, ".turn.assistant .stats, .turn .error"))
    driver.find_element(By.ID, "input").send_keys(message, Keys.ENTER)
    wait(driver, lambda: len(driver.find_elements(
        By.CSS_SELECTOR, ".turn.assistant .stats, .turn .error")) > before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    proc = start_server(args.model, port)
    driver = browser()
    try:
        open_page(driver, url)
        fill(driver, "system", "You are a concise assistant.")
        fill(driver, "temperature", "0")
        fill(driver, "max-tokens", "80")
        say(driver, "What is the capital of France?")
        say(driver, "And of Italy?")
        driver.find_element(By.ID, "input").send_keys("Which one is larger?")
        driver.save_screenshot(str(args.out / "chat_page.png"))

        open_page(driver, url)
        fill(driver, "temperature", "0")
        fill(driver, "max-tokens", "120")
        fill(driver, "schema", json.dumps(SCHEMA, indent=1))
        driver.find_element(By.ID, "schema").send_keys(Keys.CONTROL, Keys.HOME)  # its top in view
        say(driver, "Describe Paris: its country and its landmarks.")
        driver.save_screenshot(str(args.out / "chat_page_json.png"))
    finally:
        driver.quit()
        stop_server(proc)
    print(f"saved {args.out / 'chat_page.png'} and {args.out / 'chat_page_json.png'}")


if __name__ == "__main__":
    main()
