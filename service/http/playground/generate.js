// The Generate view: the prompt and decoding parameters (bounds read from the server), the
// answer streamed token by token from /generate_stream (beams: /generate, answered whole), each
// token coloured by its probability with its alternatives on hover or focus, and Stop.

import { $, ApiError, clearError, events, percent, probabilityColour, request, showError, visible } from "./api.js";

const PARAMS = ["max_new_tokens", "temperature", "top_k", "top_p", "min_p", "typical_p", "repetition_penalty",
  "seed", "num_beams", "top_n_tokens"];
const integerParams = new Set(["max_new_tokens", "top_k", "seed", "num_beams", "top_n_tokens"]);

let controller = null; // the running generation's, so Stop (or Esc) can abort it
let afterGeneration = () => {};
let tokens = []; // what the popover shows: {index, id, text, logprob, special, top}
export let lastText = ""; // prompt + generated text, for the Inspect view

// --- bounds: the OpenAPI schema's, tightened by the deployment's limits in /info ----------------

function resolve(openapi, schema) {
  while (schema && schema.$ref) schema = openapi.components.schemas[schema.$ref.split("/").pop()];
  return schema;
}

function concrete(schema) {
  const options = schema.anyOf || schema.allOf || [schema];
  return options.find((option) => option.type !== "null") || schema;
}

// Past 2^53 a JSON number is not exact in JavaScript (a seed's 2^64 - 1): said as an approximation.
const exact = (n) => (n === undefined || Math.abs(n) <= Number.MAX_SAFE_INTEGER ? n : `\u2248${n.toExponential(3)}`);

function describeBounds(s) {
  const low = exact(s.exclusiveMinimum ?? s.minimum);
  const high = exact(s.exclusiveMaximum ?? s.maximum);
  const parts = [];
  if (low !== undefined) parts.push(`${low} ${s.exclusiveMinimum !== undefined ? "<" : "\u2264"}`);
  parts.push("x");
  if (high !== undefined) parts.push(`${s.exclusiveMaximum !== undefined ? "<" : "\u2264"} ${high}`);
  return parts.length > 1 ? parts.join(" ") : "";
}

export function showBounds(openapi, info) {
  const body = openapi.paths["/generate_stream"].post.requestBody.content["application/json"].schema;
  const parameters = resolve(openapi, concrete(resolve(openapi, resolve(openapi, body).properties.parameters)));
  const limits = { max_new_tokens: info.max_new_tokens, num_beams: info.max_best_of };
  for (const name of [...PARAMS, "stop"]) {
    const schema = concrete(resolve(openapi, parameters.properties[name]));
    const s = { ...schema };
    if (limits[name] !== undefined && (s.maximum === undefined || limits[name] < s.maximum)) s.maximum = limits[name];
    const input = $(`p-${name}`);
    let text = describeBounds(s);
    if (name === "stop") text = `at most ${Math.min(info.max_stop_sequences, s.maxItems ?? Infinity)}`;
    if (name === "top_n_tokens") text += "; none with beams";
    if (!text) continue;
    const hint = document.createElement("span");
    hint.className = "bounds";
    hint.id = `b-${name}`;
    hint.textContent = text;
    input.setAttribute("aria-describedby", hint.id);
    input.closest(".param").append(hint);
    // Shown, not enforced: the form sends what is typed, and the server's 422 says what is wrong.
    if (s.minimum !== undefined) input.min = s.minimum;
    if (s.maximum !== undefined) input.max = s.maximum;
  }
}

// --- the request ---------------------------------------------------------------------------------

function readParameters() {
  const parameters = { details: true };
  for (const name of PARAMS) {
    const raw = $(`p-${name}`).value.trim();
    if (raw === "") continue;
    parameters[name] = integerParams.has(name) && /^-?\d+$/.test(raw) ? (Number.isSafeInteger(Number(raw)) ? Number(raw) : BigInt(raw)) : Number(raw);
  }
  const stop = $("p-stop").value.split("\n").filter((line) => line !== "");
  if (stop.length) parameters.stop = stop;
  // Sent as the text typed: the server parses it and says what is wrong (a 422, shown as any other).
  const schema = $("p-grammar").value.trim();
  if (schema) parameters.grammar = { type: "json", value: schema };
  if ($("p-do_sample").checked) parameters.do_sample = true;
  if ((parameters.num_beams ?? 1) > 1) delete parameters.top_n_tokens; // the server refuses alternatives with beams
  return parameters;
}

function setRunning(running) {
  $("generate").disabled = running;
  $("stop").disabled = !running;
  $("output").setAttribute("aria-busy", String(running));
}

export function stop() {
  if (controller) controller.abort();
}

export async function generate() {
  if (controller) return;
  const prompt = $("prompt").value;
  const parameters = readParameters();
  const output = $("output");
  clearError($("generate-error"));
  hidePopover();
  tokens = [];
  output.replaceChildren(Object.assign(document.createElement("span"), { className: "prompt", textContent: prompt }));
  controller = new AbortController();
  setRunning(true);
  const status = $("generate-status");
  status.textContent = "generating…";
  const started = performance.now();
  let generated = "";
  try {
    if ((parameters.num_beams ?? 1) > 1) {
      const answer = await (await request("/generate", { inputs: prompt, parameters }, controller.signal)).json();
      answer.details.tokens.forEach((token, i) => addToken({ index: i + 1, token }));
      generated = answer.generated_text;
      status.textContent = finished(answer.details, started);
    } else {
      let ended = false;
      for await (const event of events("/generate_stream", { inputs: prompt, parameters }, controller.signal)) {
        // The 200 was already sent: a failure after it comes as an event of the stream.
        if (event.error !== undefined) throw new ApiError(null, event.error_type, event.error);
        addToken(event);
        if (event.generated_text !== null) {
          ended = true;
          generated = event.generated_text;
          status.textContent = finished(event.details, started);
        }
      }
      if (!ended) {
        generated = tokens.map((t) => t.text).join("");
        status.textContent = `the stream ended without its last event, after ${tokens.length} tokens`;
      }
    }
    lastText = prompt + generated;
  } catch (error) {
    if (error.name === "AbortError") {
      status.textContent = `stopped after ${tokens.length} tokens`;
      lastText = prompt + tokens.map((t) => t.text).join("");
    } else {
      status.textContent = "";
      showError($("generate-error"), error);
    }
  } finally {
    controller = null;
    setRunning(false);
    afterGeneration();
  }
}

function finished(details, started) {
  const seconds = (performance.now() - started) / 1000;
  const seed = details.seed !== null && details.seed !== undefined ? `, seed ${details.seed}` : "";
  return `${details.generated_tokens} tokens in ${seconds.toFixed(2)} s, finished by ${details.finish_reason}${seed}`;
}

function addToken(event) {
  // A stream that ends without a new token repeats the last index to carry the details.
  if (tokens.length && event.index <= tokens[tokens.length - 1].index) return;
  const { id, text, logprob, special } = event.token;
  const top = (event.top_tokens || []).slice().sort((a, b) => b.logprob - a.logprob);
  tokens.push({ index: event.index, id, text, logprob, special, top });
  const span = document.createElement("span");
  span.className = special ? "tok special" : "tok";
  span.textContent = text;
  span.tabIndex = 0;
  span.dataset.index = event.index;
  span.dataset.id = id;
  span.style.backgroundColor = probabilityColour(logprob);
  span.setAttribute("aria-label", `${visible(text)}, probability ${percent(logprob)}`);
  $("output").append(span);
}

// --- the alternatives popover -----------------------------------------------------------------

function showPopover(span) {
  const token = tokens.find((t) => String(t.index) === span.dataset.index);
  if (!token) return;
  const popover = $("token-popover");
  const table = document.createElement("table");
  const caption = table.createCaption();
  caption.textContent = `token ${token.index} (id ${token.id})`;
  const rows = token.top.length ? token.top : [token];
  for (const alternative of rows) {
    const row = table.insertRow();
    row.dataset.id = alternative.id;
    if (alternative.id === token.id) row.className = "chosen";
    row.insertCell().textContent = visible(alternative.text);
    const p = row.insertCell();
    p.className = "p";
    p.textContent = percent(alternative.logprob);
  }
  popover.replaceChildren(table);
  popover.hidden = false;
  const box = span.getBoundingClientRect();
  popover.style.left = `${Math.max(4, Math.min(window.scrollX + box.left, window.scrollX + document.documentElement.clientWidth - popover.offsetWidth - 4))}px`;
  popover.style.top = `${window.scrollY + box.bottom + 4}px`;
  span.setAttribute("aria-describedby", "token-popover");
}

export function hidePopover() {
  $("token-popover").hidden = true;
}

export function setUpGenerate(onFinished) {
  afterGeneration = onFinished;
  $("generate-form").addEventListener("submit", (event) => {
    event.preventDefault();
    generate();
  });
  $("stop").addEventListener("click", stop);
  const output = $("output");
  for (const type of ["mouseover", "focusin"]) {
    output.addEventListener(type, (event) => {
      if (event.target.classList.contains("tok")) showPopover(event.target);
    });
  }
  for (const type of ["mouseout", "focusout"]) {
    output.addEventListener(type, (event) => {
      if (event.target.classList.contains("tok")) hidePopover();
    });
  }
}
