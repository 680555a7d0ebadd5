"""Debian's headless Chromium driven by Selenium through Debian's chromedriver (never a
downloaded one), and what the tests read from it: the console and the requests the page made."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
MISSING = (
    None if CHROMIUM and CHROMEDRIVER else
    "Debian's chromium and chromium-driver are not installed (`make system-deps` installs them as root)"
)


@contextmanager
def chromium(width: int = 1200, height: int = 900) -> Iterator:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     "--no-first-run", "--disable-extensions", f"--window-size={width},{height}"):
        options.add_argument(argument)
    # The console (browser) and the network (performance) logs, read after each action.
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def console_errors(driver, allowed_statuses: tuple[int, ...] = ()) -> list[str]:
    """SEVERE console entries since the last call, less the failed-response lines of the statuses
    a test provoked on purpose (Chromium logs every 4xx answer to fetch as an error)."""
    errors = []
    for entry in driver.get_log("browser"):
        if entry["level"] != "SEVERE":
            continue
        if entry.get("source") == "network" and any(f"status of {s} " in entry["message"] for s in allowed_statuses):
            continue
        errors.append(entry["message"])
    return errors


def requests_made(driver, origin: str) -> list[tuple[str, str]]:
    """(method, path) of every request the page sent to `origin` since the last call; any request
    elsewhere is returned with its full URL (there should be none)."""
    made = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] != "Network.requestWillBeSent":
            continue
        request = message["params"]["request"]
        url = request["url"]
        if url.startswith("data:"):
            continue
        made.append((request["method"], urlsplit(url).path if url.startswith(origin + "/") else url))
    return made
