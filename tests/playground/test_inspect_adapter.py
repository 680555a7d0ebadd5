"""The Inspect view's LoRA adapter choice, in a browser: the select lists the server's adapters, and
with one chosen the spectrum is the fine-tuned model's, its base's curve beside it."""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import Select

from tests.playground.test_browser import fill, open_page, status, thirty_token_text, wait_for
from tests.service.live import live_server

peft = pytest.importorskip("peft")
from tests.model.test_lora import PEFT_CONFIGS, peft_adapter  # noqa: E402


@pytest.fixture(scope="module")
def adapter_server(playground_model_dir: Path, tmp_path_factory):
    folder = peft_adapter(tmp_path_factory.mktemp("adapter"), playground_model_dir, **PEFT_CONFIGS["all-modules"])
    with live_server(playground_model_dir, lora=f"poems={folder}", max_batch_size=2) as running:
        yield running


def shown_means(browser, selector: str) -> list[float]:
    points = browser.find_elements(By.CSS_SELECTOR, selector)
    return [float(p.find_element(By.TAG_NAME, "title").get_attribute("textContent").split("\u2082 ")[1].split()[0]) for p in points]


def test_a_chosen_adapter_is_inspected_beside_its_base(browser, adapter_server, tokenizer) -> None:
    open_page(browser, adapter_server)
    browser.find_element(By.ID, "tab-inspect").click()
    choice = Select(browser.find_element(By.ID, "inspect-adapter"))
    wait_for(browser, lambda d: [o.get_attribute("value") for o in choice.options] == ["", "poems"])
    text = thirty_token_text(tokenizer)
    fill(browser, "inspect-text", text)
    choice.select_by_value("poems")
    browser.find_element(By.ID, "inspect-text").send_keys(Keys.CONTROL, Keys.ENTER)
    wait_for(browser, lambda d: status(d, "inspect-status") == "30 tokens inspected")

    report = httpx.post(adapter_server.url + "/analyze/spectrum",
                        json={"texts": [text], "adapter": "poems", "compare": "base"}, timeout=60).json()
    tuned, base = report["layers"], report["compare"][0]["layers"]
    for shown, expected in ((shown_means(browser, "#spectrum circle.series-mean"), tuned),
                            (shown_means(browser, "#spectrum circle.series-compare"), base)):
        assert len(shown) == len(expected)
        assert all(math.isclose(s, e["spectral_norm"]["mean"], abs_tol=1e-4) for s, e in zip(shown, expected))
    assert "+ poems" in browser.find_element(By.ID, "spectrum-legend").text
