"""The playground in a real browser (Debian's headless Chromium) against a live server: what a
person does with it, checked against what the API answers for the same request."""

from __future__ import annotations

import json
import math

import httpx
import pytest
from selenium.webdriver import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import Select, WebDriverWait

from service.http.auth import OPEN_PATHS
from tests.playground.browser import MISSING, chromium, console_errors, requests_made
from tests.service.live import WAIT_S, live_server, wait_until

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
PAGE_FILES = {"/", "/playground/app.js", "/playground/api.js", "/playground/generate.js",
              "/playground/inspect.js", "/playground/app.css"}


def open_page(driver, server) -> None:
    driver.get(server.url + "/")
    wait_for(driver, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "true")


def wait_for(driver, condition):
    return WebDriverWait(driver, WAIT_S, poll_frequency=0.05).until(condition)


def fill(driver, element_id: str, text: str) -> None:
    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(text)


def documented(server) -> dict[str, set[str]]:
    """The API's routes and their methods, from its OpenAPI schema (which is documented too)."""
    paths = httpx.get(server.url + "/openapi.json", timeout=30).json()["paths"]
    return {path: {method.upper() for method in methods} for path, methods in paths.items()}


def assert_only_documented_requests(driver, server) -> list[tuple[str, str]]:
    routes = documented(server)
    made = requests_made(driver, server.url)
    for method, path in made:
        known = path in PAGE_FILES or (method, path) == ("GET", "/openapi.json") or method in routes.get(path, ())
        assert known, f"undocumented request {method} {path}"
    return made


def status(driver, element_id: str = "generate-status") -> str:
    return driver.find_element(By.ID, element_id).text


def token_spans(driver) -> list[dict]:
    return driver.execute_script(
        "return [...document.querySelectorAll('#output .tok')].map(s => ({index: +s.dataset.index, id: +s.dataset.id}));"
    )


def test_generate_streams_the_apis_tokens_in_order(browser, server) -> None:
    open_page(browser, server)
    # The bounds shown are the server's: its max_new_tokens (1000 here) from /info, the rest from the schema.
    assert browser.find_element(By.ID, "b-max_new_tokens").text == "1 \u2264 x \u2264 1000"
    assert browser.find_element(By.ID, "b-temperature").text == "0 < x \u2264 100"
    assert browser.find_element(By.ID, "info-model").text == "gpt2"
    fill(browser, "prompt", PROMPT)
    fill(browser, "p-max_new_tokens", "16")
    fill(browser, "p-temperature", "0.8")
    fill(browser, "p-seed", "1234")
    # Every token span, in the order the page added them.
    browser.execute_script("""
        window.seen = [];
        new MutationObserver(changes => changes.forEach(change => change.addedNodes.forEach(node => {
            if (node.dataset && node.dataset.index) window.seen.push(+node.dataset.index);
        }))).observe(document.getElementById('output'), {childList: true});
    """)
    browser.find_element(By.ID, "prompt").send_keys(Keys.CONTROL, Keys.ENTER)
    wait_for(browser, lambda d: "finished by" in status(d))

    parameters = {"max_new_tokens": 16, "temperature": 0.8, "seed": 1234, "top_n_tokens": 3, "details": True}
    answer = httpx.post(server.url + "/generate", json={"inputs": PROMPT, "parameters": parameters}, timeout=60).json()
    expected = [token["id"] for token in answer["details"]["tokens"]]
    assert browser.execute_script("return window.seen;") == list(range(1, 17))
    assert [span["id"] for span in token_spans(browser)] == expected
    shown = browser.execute_script("return [...document.querySelectorAll('#output .tok')].map(s => s.textContent).join('');")
    assert shown == answer["generated_text"]

    # Each token's alternatives, shown on focus (keyboard) and on hover, are the API's top_tokens.
    spans = browser.find_elements(By.CSS_SELECTOR, "#output .tok")
    popover = browser.find_element(By.ID, "token-popover")
    for span, alternatives in zip(spans, answer["details"]["top_tokens"]):
        browser.execute_script("arguments[0].focus();", span)
        assert popover.is_displayed()
        rows = popover.find_elements(By.CSS_SELECTOR, "tr")
        assert {int(row.get_attribute("data-id")) for row in rows} == {alt["id"] for alt in alternatives}
    browser.find_element(By.ID, "prompt").click()
    assert not popover.is_displayed()
    ActionChains(browser).move_to_element(spans[0]).perform()
    assert popover.is_displayed()

    made = assert_only_documented_requests(browser, server)
    assert ("POST", "/generate_stream") in made
    assert console_errors(browser) == []


def test_stop_cancels_the_request_and_frees_its_slot(browser, server) -> None:
    open_page(browser, server)
    cancelled = server.metric("gpt2_requests_total", endpoint="/generate_stream", outcome="cancelled")
    fill(browser, "prompt", PROMPT)
    fill(browser, "p-max_new_tokens", "1000")
    for name in ("p-temperature", "p-seed"):
        browser.find_element(By.ID, name).clear()
    browser.find_element(By.ID, "generate").click()
    wait_for(browser, lambda d: len(token_spans(d)) >= 5)
    wait_until(lambda: server.slots_used() == 1, WAIT_S, "the engine to report the request's slot")
    browser.find_element(By.TAG_NAME, "body").send_keys(Keys.ESCAPE)
    wait_for(browser, lambda d: status(d).startswith("stopped after"))
    wait_until(lambda: server.slots_used() == 0, WAIT_S, "the stopped request's slot to be freed")
    wait_until(
        lambda: server.metric("gpt2_requests_total", endpoint="/generate_stream", outcome="cancelled") == cancelled + 1,
        WAIT_S, "the server to count the request as cancelled",
    )
    assert len(token_spans(browser)) < 1000
    assert browser.find_element(By.ID, "generate").is_enabled()
    assert not browser.find_element(By.ID, "stop").is_enabled()
    assert console_errors(browser) == []


def test_bad_parameter_shows_the_servers_422(browser, server) -> None:
    open_page(browser, server)
    fill(browser, "prompt", PROMPT)
    fill(browser, "p-max_new_tokens", "4")
    fill(browser, "p-temperature", "-1")
    browser.find_element(By.ID, "generate").click()
    error = browser.find_element(By.ID, "generate-error")
    wait_for(browser, lambda d: error.is_displayed())
    parameters = {"max_new_tokens": 4, "temperature": -1, "top_n_tokens": 3, "details": True}
    refused = httpx.post(server.url + "/generate_stream", json={"inputs": PROMPT, "parameters": parameters}, timeout=30)
    assert refused.status_code == 422
    assert error.text == f"422 validation: {refused.json()['error']}"
    assert error.get_attribute("role") == "alert"
    assert token_spans(browser) == []
    browser.find_element(By.ID, "p-temperature").clear()
    assert console_errors(browser, allowed_statuses=(422,)) == []


def test_a_json_schema_makes_the_answer_parse(browser, server) -> None:
    open_page(browser, server)
    schema = '{"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["answer", "n"], "additionalProperties": false}'
    fill(browser, "prompt", PROMPT)
    fill(browser, "p-max_new_tokens", "40")
    fill(browser, "p-grammar", schema)
    browser.find_element(By.ID, "generate").click()
    wait_for(browser, lambda d: "finished by" in status(d))
    shown = browser.execute_script("return [...document.querySelectorAll('#output .tok')].map(s => s.textContent).join('');")
    answer = json.loads(shown)
    assert answer["answer"] in ("yes", "no") and 0 <= answer["n"] <= 9 and set(answer) == {"answer", "n"}
    fill(browser, "p-grammar", "{not json")
    browser.find_element(By.ID, "generate").click()
    error = browser.find_element(By.ID, "generate-error")
    wait_for(browser, lambda d: error.is_displayed())
    assert "not JSON" in error.text
    browser.find_element(By.ID, "p-grammar").clear()
    assert console_errors(browser, allowed_statuses=(422,)) == []


def thirty_token_text(tokenizer) -> str:
    ids = tokenizer.encode(
        "Attention maps show which earlier tokens each position reads from, layer by layer and head by head,"
        " while the logit lens decodes the residual stream after every block of the model."
    )[:30]
    text = tokenizer.decode(ids)
    assert len(tokenizer.encode(text)) == 30
    return text


def luminance(rgba) -> float:
    return 0.2126 * rgba[0] + 0.7152 * rgba[1] + 0.0722 * rgba[2]


def test_inspect_views_render_for_a_30_token_text(browser, server, tokenizer) -> None:
    open_page(browser, server)
    info = server.get("/info").json()["config"]
    text = thirty_token_text(tokenizer)
    browser.find_element(By.ID, "tab-inspect").click()
    assert not browser.find_element(By.ID, "generate-panel").is_displayed()
    fill(browser, "inspect-text", text)
    browser.find_element(By.ID, "inspect-text").send_keys(Keys.CONTROL, Keys.ENTER)
    wait_for(browser, lambda d: status(d, "inspect-status") == "30 tokens inspected")

    # The spectral-norm curve: one point per layer, at the API's means; the comparison model's
    # curve (3 layers) beside it; the valid bounds as lines.
    report = httpx.post(server.url + "/analyze/spectrum", json={"texts": [text]}, timeout=60).json()
    points = browser.find_elements(By.CSS_SELECTOR, "#spectrum circle.series-mean")
    assert [int(p.get_attribute("data-layer")) for p in points] == list(range(info["n_layer"]))
    compare_points = browser.find_elements(By.CSS_SELECTOR, "#spectrum circle.series-compare")
    assert len(compare_points) == report["compare"][0]["model"]["n_layer"] == 3
    for point, layer in zip(points, report["layers"]):
        shown = float(point.find_element(By.TAG_NAME, "title").get_attribute("textContent").split("\u2082 ")[1].split()[0])
        assert math.isclose(shown, layer["spectral_norm"]["mean"], abs_tol=1e-4)
    bounds = {b.get_attribute("class").split()[1] for b in browser.find_elements(By.CSS_SELECTOR, "#spectrum polyline.bound")}
    assert bounds == {f"bound-{name}" for name, b in report["layers"][0]["bounds"].items() if b["valid"]}

    # The heatmap: T×T cells, the brightest cell of each row where the API's attention peaks,
    # nothing above the diagonal (causal). Checked after switching layer and head.
    Select(browser.find_element(By.ID, "attention-layer")).select_by_value("2")
    Select(browser.find_element(By.ID, "attention-head")).select_by_value("3")
    canvas = browser.find_element(By.ID, "attention")
    wait_for(browser, lambda d: "layer 2, head 3" in canvas.get_attribute("aria-label"))
    assert (int(canvas.get_attribute("width")), int(canvas.get_attribute("height"))) == (30, 30)
    pixels = browser.execute_script(
        "const c = arguments[0]; return Array.from(c.getContext('2d').getImageData(0, 0, c.width, c.height).data);", canvas
    )
    cell = [[pixels[4 * (q * 30 + k): 4 * (q * 30 + k) + 4] for k in range(30)] for q in range(30)]
    attention = httpx.post(server.url + "/analyze/attention", json={"text": text, "layers": [2]}, timeout=60).json()
    matrix = attention["layers"][0]["attention"][3]
    zero = cell[0][1]
    for q in range(30):
        assert all(cell[q][k] == zero for k in range(q + 1, 30))
        brightest = max(range(q + 1), key=lambda k: luminance(cell[q][k]))
        assert matrix[q][brightest] == pytest.approx(max(matrix[q][: q + 1]), abs=0.02)

    # The arrow keys move the readout over the cells.
    canvas.send_keys(Keys.ARROW_DOWN, Keys.ARROW_DOWN, Keys.ARROW_RIGHT)
    readout = browser.find_element(By.ID, "attention-readout").text
    assert readout.startswith("query 2 ") and "key 1 " in readout and readout.endswith(f"{matrix[2][1]:.4f}")

    # The logit lens: a row per layer (and the embeddings), a column per token, the API's top tokens.
    lens = httpx.post(server.url + "/analyze/logit-lens", json={"text": text, "top_k": 3}, timeout=60).json()
    rows = browser.find_elements(By.CSS_SELECTOR, "#lens tbody tr")
    assert len(rows) == info["n_layer"] + 1
    assert len(browser.find_elements(By.CSS_SELECTOR, "#lens thead th[scope=col]")) == 30
    for row, layer in zip(rows, lens["layers"]):
        ids = [int(td.get_attribute("data-id")) for td in row.find_elements(By.TAG_NAME, "td")]
        assert ids == [top[0]["id"] for top in layer["top"]]

    assert_only_documented_requests(browser, server)
    assert console_errors(browser) == []


def test_phone_width_needs_no_sideways_scrolling(browser, server) -> None:
    browser.set_window_size(390, 844)
    try:
        open_page(browser, server)
        for tab in ("tab-generate", "tab-inspect"):
            browser.find_element(By.ID, tab).click()
            assert browser.execute_script("return document.documentElement.scrollWidth <= window.innerWidth;")
    finally:
        browser.set_window_size(1200, 900)


def test_with_an_api_key_no_route_answers_the_page_without_it(playground_model_dir) -> None:
    if MISSING:
        pytest.skip(MISSING)
    key = "open-sesame"
    with live_server(playground_model_dir, api_key=key) as server, chromium() as driver:
        driver.get(server.url + "/")
        key_form = driver.find_element(By.ID, "key-form")
        wait_for(driver, lambda d: key_form.is_displayed())
        assert driver.find_element(By.ID, "model-info").text == ""
        # Every route of the API refuses a request without the key (the probes and the scrape,
        # which the page never calls, stay open by design).
        routes = httpx.get(server.url + "/openapi.json", headers={"Authorization": f"Bearer {key}"}, timeout=30).json()
        for path, methods in routes["paths"].items():
            if path in OPEN_PATHS:
                continue
            for method in methods:
                answer = httpx.request(method.upper(), server.url + path, json={}, timeout=30)
                assert answer.status_code == 401, (method, path, answer.status_code)
        assert console_errors(driver, allowed_statuses=(401,)) == []

        fill(driver, "api-key", key)
        driver.find_element(By.CSS_SELECTOR, "#key-form button").click()
        wait_for(driver, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "true")
        assert not key_form.is_displayed()
        assert driver.find_element(By.ID, "info-model").text == "gpt2"
        fill(driver, "p-max_new_tokens", "3")
        driver.find_element(By.ID, "generate").click()
        wait_for(driver, lambda d: "finished by" in status(d))
        assert len(token_spans(driver)) == 3
        assert console_errors(driver) == []
