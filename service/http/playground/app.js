// The playground's start: the model served (/info), the parameters' bounds (/openapi.json), the
// API key when the server asks for one, the two views as tabs, and the keyboard (Ctrl-Enter
// runs the view's action, Esc stops a generation).

import { $, clearError, getJson, setKey, showError, whenUnauthorized } from "./api.js";
import { hidePopover, lastText, setUpGenerate, showBounds, stop, generate } from "./generate.js";
import { inspect, setModel, setUpInspect } from "./inspect.js";

function formatCount(n) {
  return n >= 1e9 ? `${(n / 1e9).toFixed(2)}B` : n >= 1e6 ? `${(n / 1e6).toFixed(1)}M` : n >= 1e3 ? `${(n / 1e3).toFixed(1)}k` : String(n);
}

function showInfo(info) {
  const c = info.config;
  const entries = [
    ["model", info.model_id],
    ["size", `${formatCount(c.parameters)} parameters, ${c.n_layer} layers \u00d7 ${c.n_head} heads, width ${c.n_embd}`],
    ["dtype", info.model_dtype],
    ["device", info.model_device_type],
    ["weights", info.weights_origin.source ?? "unknown"],
    ["quantization", info.quantization.mode],
    ["context", `${info.max_total_tokens} tokens`],
  ];
  $("model-info").replaceChildren(...entries.map(([term, value]) => {
    const group = document.createElement("div");
    const dt = document.createElement("dt");
    const dd = document.createElement("dd");
    dt.textContent = term;
    dd.textContent = value;
    dd.id = `info-${term}`;
    group.append(dt, dd);
    return group;
  }));
}

async function start() {
  try {
    // Both asked for at once; the model is shown before the schema (built on its first request) arrives.
    const openapi = getJson("/openapi.json");
    openapi.catch(() => {}); // its failure is reported below, once
    const info = await getJson("/info");
    showInfo(info);
    setModel(info.config);
    showBounds(await openapi, info);
    $("key-form").hidden = true;
    document.body.dataset.ready = "true";
  } catch (error) {
    if (error.status !== 401) showError($("generate-error"), error);
  }
}

function selectTab(tab) {
  for (const each of document.querySelectorAll('[role="tab"]')) {
    const selected = each === tab;
    each.setAttribute("aria-selected", String(selected));
    each.tabIndex = selected ? 0 : -1;
    $(each.getAttribute("aria-controls")).hidden = !selected;
  }
  hidePopover();
}

function setUpTabs() {
  const tabs = [...document.querySelectorAll('[role="tab"]')];
  tabs.forEach((tab, i) => {
    tab.addEventListener("click", () => selectTab(tab));
    tab.addEventListener("keydown", (event) => {
      const step = { ArrowRight: 1, ArrowLeft: -1 }[event.key];
      if (!step) return;
      const next = tabs[(i + step + tabs.length) % tabs.length];
      selectTab(next);
      next.focus();
    });
  });
}

function setUpKey() {
  whenUnauthorized(() => {
    $("key-form").hidden = false;
    $("api-key").focus();
  });
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    setKey($("api-key").value.trim());
    $("api-key").value = "";
    clearError($("generate-error"));
    start();
  });
}

function setUpKeyboard() {
  document.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
      event.preventDefault();
      if ($("inspect-panel").hidden) generate();
      else inspect();
    } else if (event.key === "Escape") {
      stop();
      hidePopover();
    }
  });
}

setUpKey();
setUpTabs();
setUpKeyboard();
setUpGenerate(() => {
  // The Inspect view starts from the last generation's text, unless the user wrote their own.
  const text = $("inspect-text");
  if (!text.dataset.edited) text.value = lastText;
});
$("inspect-text").addEventListener("input", (event) => { event.target.dataset.edited = "true"; });
setUpInspect();
start();
