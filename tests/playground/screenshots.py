"""Screenshots of the playground's two views for docs/playground.md, taken in Debian's headless
Chromium against a live server, and what the first load cost as the browser measured it.

    .venv/bin/python -m tests.playground.screenshots [--model-dir weights/gpt2] [--out docs/figures]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from selenium.webdriver import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import Select, WebDriverWait

from tests.conftest import DEFAULT_MODEL_DIR
from tests.playground.browser import MISSING, chromium
from tests.service.live import WAIT_S, live_server

PROMPT = "The capital of France is"
# What the page fetched before it was ready (its files, /info, /openapi.json) and when it was ready,
# from the browser's own Navigation and Resource Timing.
FIRST_LOAD = """
const navigation = performance.getEntriesByType('navigation')[0];
const resources = performance.getEntriesByType('resource');
const ready = Math.max(navigation.domContentLoadedEventEnd, ...resources.map(r => r.responseEnd));
const bytes = resources.reduce((sum, r) => sum + r.transferSize, navigation.transferSize);
return {ready_ms: ready, page_bytes: bytes};
"""


def take(model_dir: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with live_server(model_dir) as server, chromium(1200, 1000) as driver:
        wait = WebDriverWait(driver, WAIT_S, poll_frequency=0.05)
        driver.get(server.url + "/")
        wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "true")
        print("first load:", driver.execute_script(FIRST_LOAD))

        fields = {"prompt": PROMPT, "p-max_new_tokens": "30", "p-temperature": "0.9", "p-seed": "42"}
        for element_id, text in fields.items():
            driver.find_element(By.ID, element_id).clear()
            driver.find_element(By.ID, element_id).send_keys(text)
        driver.find_element(By.ID, "generate").click()
        wait.until(lambda d: "finished by" in d.find_element(By.ID, "generate-status").text)
        ActionChains(driver).move_to_element(driver.find_elements(By.CSS_SELECTOR, "#output .tok")[6]).perform()
        driver.save_screenshot(str(out / "playground-generate.png"))

        driver.find_element(By.ID, "tab-inspect").click()
        driver.find_element(By.ID, "inspect").click()
        wait.until(lambda d: d.find_element(By.ID, "inspect-status").text.endswith("tokens inspected"))
        Select(driver.find_element(By.ID, "attention-layer")).select_by_value("5")
        Select(driver.find_element(By.ID, "attention-head")).select_by_value("1")
        heatmap = driver.find_element(By.ID, "attention")
        wait.until(lambda d: "layer 5, head 1" in heatmap.get_attribute("aria-label"))
        heatmap.send_keys(*[Keys.ARROW_DOWN] * 9, *[Keys.ARROW_RIGHT] * 4)  # a cell, as a keyboard user reaches it
        driver.set_window_size(1200, driver.execute_script("return document.documentElement.scrollHeight;") + 120)
        driver.save_screenshot(str(out / "playground-inspect.png"))
    print("written:", out / "playground-generate.png", out / "playground-inspect.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--out", type=Path, default=Path("docs/figures"))
    args = parser.parse_args()
    if MISSING:
        raise SystemExit(MISSING)
    take(args.model_dir, args.out)


if __name__ == "__main__":
    main()
