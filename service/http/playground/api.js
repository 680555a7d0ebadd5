// The page's only way to the server: the documented API, with the user's key when one is set,
// and errors as the server wrote them ({error, error_type}).

const KEY_STORAGE = "gpt2-serve-api-key"; // sessionStorage: this tab only, gone when it closes

export class ApiError extends Error {
  constructor(status, errorType, message, retryAfter) {
    super(message);
    this.status = status;
    this.errorType = errorType;
    this.retryAfter = retryAfter;
  }

  describe() {
    const retry = this.retryAfter ? ` (retry after ${this.retryAfter} s)` : "";
    const status = this.status ? `${this.status} ` : ""; // none for an error event inside a stream
    return `${status}${this.errorType}: ${this.message}${retry}`;
  }
}

let onUnauthorized = () => {};

export function whenUnauthorized(callback) {
  onUnauthorized = callback;
}

export function setKey(key) {
  if (key) sessionStorage.setItem(KEY_STORAGE, key);
  else sessionStorage.removeItem(KEY_STORAGE);
}

function headers(json) {
  const out = {};
  const key = sessionStorage.getItem(KEY_STORAGE);
  if (key) out.Authorization = `Bearer ${key}`;
  if (json) out["Content-Type"] = "application/json";
  return out;
}

// JSON with integers beyond 2^53 (a 64-bit seed) written exactly: they travel as BigInt.
function toJson(body) {
  const marked = JSON.stringify(body, (_, value) => (typeof value === "bigint" ? `\u0000big${value}` : value));
  return marked.replace(/"\\u0000big(-?\d+)"/g, "$1");
}

async function errorFrom(response) {
  let errorType = "error";
  let message = response.statusText || "request failed";
  try {
    const body = await response.json();
    if (typeof body.error === "string") {
      message = body.error;
      errorType = body.error_type || errorType;
    }
  } catch {
    // Not the service's JSON (a proxy's page): the status line says what there is to say.
  }
  return new ApiError(response.status, errorType, message, response.headers.get("Retry-After"));
}

// GET when body is undefined, else POST of JSON. Resolves to the Response; rejects with ApiError.
export async function request(path, body, signal) {
  const init = { method: body === undefined ? "GET" : "POST", headers: headers(body !== undefined), signal };
  if (body !== undefined) init.body = toJson(body);
  const response = await fetch(path, init);
  if (!response.ok) {
    const error = await errorFrom(response);
    if (response.status === 401) onUnauthorized(error);
    throw error;
  }
  return response;
}

export async function getJson(path, body) {
  return (await request(path, body)).json();
}

// Server-sent events of a POST: each event's JSON payload, as it arrives.
export async function* events(path, body, signal) {
  const response = await request(path, body, signal);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block.split("\n").filter((line) => line.startsWith("data:")).map((line) => line.slice(5).trim()).join("\n");
      if (data) yield JSON.parse(data);
    }
  }
}

// --- small DOM helpers shared by the views -----------------------------------------------------

export const $ = (id) => document.getElementById(id);

export function showError(element, error) {
  element.textContent = error instanceof ApiError ? error.describe() : String(error && error.message || error);
  element.hidden = false;
}

export function clearError(element) {
  element.textContent = "";
  element.hidden = true;
}

// Probability → background: red (unlikely) through yellow to green (likely).
export function probabilityColour(logprob) {
  const p = Math.exp(logprob);
  return `hsl(${Math.round(130 * p)} 75% 80%)`;
}

// A token's text made visible: spaces and line breaks shown, not swallowed.
export function visible(text) {
  return text.replace(/ /g, "\u2423").replace(/\n/g, "\u23ce").replace(/\t/g, "\u21e5") || "\u2205";
}

export function percent(logprob) {
  const p = 100 * Math.exp(logprob);
  return p >= 10 ? `${p.toFixed(0)}%` : `${p.toPrecision(2)}%`;
}
