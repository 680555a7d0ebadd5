// The Inspect view: for one text, the per-layer attention spectral norm with its valid bounds
// (/analyze/spectrum), an attention heatmap per layer and head (/analyze/attention), and the
// logit lens (/analyze/logit-lens). The server runs one analysis at a time (429 beyond), so the
// three are asked for one after another. With a LoRA adapter chosen (/analyze/adapters lists
// them), all three read the fine-tuned model, and the spectrum sets its base beside it.

import { $, clearError, getJson, percent, probabilityColour, showError, visible } from "./api.js";

const SVG = "http://www.w3.org/2000/svg";
const LENS_TOP_K = 3;
const BOUNDS = { // the valid bounds of docs/analysis.md, drawn as dashed lines
  lower: { label: "lower bound 1", colour: "#6b7280" },
  colsum: { label: "\u221a(max column sum)", colour: "#1a8f5a" },
  prenorm: { label: "weight-only bound", colour: "#a05ac5" },
  trivial: { label: "\u221an", colour: "#b38600" },
};
// viridis at five stops: perceptually even, readable in grey, the usual heatmap map.
const VIRIDIS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];

let model = { n_layer: 0, n_head: 0 };
let current = { text: null, adapter: null, attention: new Map(), tokens: [] }; // attention: layer → [head][query][key]
let cursor = { row: 0, col: 0 };

export function setModel(config) {
  model = config;
  const layer = $("attention-layer");
  const head = $("attention-head");
  layer.replaceChildren(...Array.from({ length: config.n_layer }, (_, i) => new Option(String(i), String(i))));
  head.replaceChildren(...Array.from({ length: config.n_head }, (_, i) => new Option(String(i), String(i))));
  refreshAdapters(); // once the server has answered /info (with the key, where it needs one)
}

// "gpt2" or "gpt2 + poems": a report's model, with the adapter applied to it if any.
function modelName(report) {
  return report.model.adapter ? `${report.model.name} + ${report.model.adapter}` : report.model.name;
}

// The adapter choice: the base model, then every adapter the analysis side has loaded now.
async function listAdapters() {
  const { adapters } = await getJson("/analyze/adapters");
  const select = $("inspect-adapter");
  const chosen = select.value; // read after the request: the user may have chosen meanwhile
  select.replaceChildren(new Option("none (the base model)", ""), ...adapters.map((name) => new Option(name, name)));
  select.value = adapters.includes(chosen) ? chosen : "";
  select.disabled = adapters.length === 0;
}

function refreshAdapters() {
  listAdapters().catch((failure) => failure.status === 401 || showError($("inspect-error"), failure));
}

function svg(tag, attributes, parent) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
  if (parent) parent.append(node);
  return node;
}

// --- spectral norm per layer ---------------------------------------------------------------------

function series(report) {
  return report.layers.map((layer) => layer.spectral_norm);
}

export function drawSpectrum(report) {
  const chart = $("spectrum");
  const width = 640, height = 320, left = 48, right = 12, top = 12, bottom = 36;
  const layers = report.layers.map((layer) => layer.layer);
  const norms = series(report);
  const compare = (report.compare || [])[0];
  const bounds = Object.keys(BOUNDS).filter((name) => report.layers.every((layer) => layer.bounds[name] && layer.bounds[name].valid));
  const boundValue = (layer, name) => layer.bounds[name].mean ?? layer.bounds[name].value;
  const values = [...norms.map((n) => n.max), ...bounds.flatMap((name) => report.layers.map((l) => boundValue(l, name)))];
  if (compare) values.push(...series(compare).map((n) => n.max));
  const yMax = Math.max(...values) * 1.05;
  const lastLayer = Math.max(...layers, ...(compare ? compare.layers.map((layer) => layer.layer) : []));
  const x = (layer) => left + (lastLayer > 0 ? layer / lastLayer : 0.5) * (width - left - right);
  const y = (value) => top + (1 - value / yMax) * (height - top - bottom);
  chart.replaceChildren();
  svg("title", { id: "spectrum-summary" }, chart).textContent =
    `Mean attention spectral norm per layer of ${modelName(report)}: ${norms.map((n) => n.mean.toFixed(3)).join(", ")}`;
  // axes and ticks
  svg("line", { class: "axis", x1: left, x2: width - right, y1: y(0), y2: y(0) }, chart);
  svg("line", { class: "axis", x1: left, x2: left, y1: top, y2: y(0) }, chart);
  const step = Math.max(1, Math.ceil((lastLayer + 1) / 12));
  for (let layer = 0; layer <= lastLayer; layer += step) {
    svg("text", { x: x(layer), y: height - bottom + 14, "text-anchor": "middle" }, chart).textContent = layer;
  }
  svg("text", { x: (left + width - right) / 2, y: height - 4, "text-anchor": "middle" }, chart).textContent = "layer";
  for (let k = 0; k <= 4; k++) {
    const value = (yMax * k) / 4;
    svg("text", { x: left - 6, y: y(value) + 4, "text-anchor": "end" }, chart).textContent = value.toFixed(value < 10 ? 2 : 0);
  }
  // the min–max band, the bounds, then the curves on top
  const band = [...norms.map((n, i) => `${x(layers[i])},${y(n.max)}`), ...norms.map((n, i) => `${x(layers[i])},${y(n.min)}`).reverse()];
  svg("polygon", { class: "band", points: band.join(" ") }, chart);
  for (const name of bounds) {
    const points = report.layers.map((layer) => `${x(layer.layer)},${y(boundValue(layer, name))}`).join(" ");
    svg("polyline", { class: `bound bound-${name}`, stroke: BOUNDS[name].colour, points }, chart);
  }
  const curves = [["series-mean", report, norms]];
  if (compare) curves.push(["series-compare", compare, series(compare)]);
  for (const [kind, each, values] of curves) {
    const xs = each.layers.map((layer) => x(layer.layer));
    svg("polyline", { class: kind, points: values.map((n, i) => `${xs[i]},${y(n.mean)}`).join(" ") }, chart);
    values.forEach((n, i) => {
      const point = svg("circle", { class: kind, cx: xs[i], cy: y(n.mean), r: 3.5, "data-layer": each.layers[i].layer }, chart);
      svg("title", {}, point).textContent = `${modelName(each)}, layer ${each.layers[i].layer}: mean \u2016A\u2016\u2082 ${n.mean.toFixed(4)} (min ${n.min.toFixed(4)}, max ${n.max.toFixed(4)})`;
    });
  }
  const legend = $("spectrum-legend");
  const entry = (label, colour) => {
    const item = document.createElement("li");
    const swatch = document.createElement("span");
    swatch.className = "swatch";
    swatch.style.background = colour;
    item.append(swatch, label);
    return item;
  };
  legend.replaceChildren(
    entry(`${modelName(report)} (${report.model.architecture}): mean \u2016A\u2016\u2082, band min\u2013max`, "#2457c5"),
    ...(compare ? [entry(`${modelName(compare)} (${compare.model.architecture}): mean`, "#c5492a")] : []),
    ...bounds.map((name) => entry(BOUNDS[name].label, BOUNDS[name].colour)),
  );
}

// --- attention heatmap ----------------------------------------------------------------------

function viridis(value) {
  const position = Math.min(1, Math.max(0, value)) * (VIRIDIS.length - 1);
  const i = Math.min(VIRIDIS.length - 2, Math.floor(position));
  const t = position - i;
  return VIRIDIS[i].map((c, k) => Math.round(c + t * (VIRIDIS[i + 1][k] - c)));
}

function heads(layer) {
  return current.attention.get(layer);
}

function drawAttention() {
  const layer = Number($("attention-layer").value);
  if (!heads(layer)) return; // that layer not read yet
  const matrix = heads(layer)[Number($("attention-head").value)];
  const size = matrix.length;
  const canvas = $("attention");
  canvas.width = size;
  canvas.height = size;
  const context = canvas.getContext("2d");
  const image = context.createImageData(size, size);
  matrix.forEach((row, q) => row.forEach((value, k) => {
    const [r, g, b] = viridis(value);
    image.data.set([r, g, b, 255], 4 * (q * size + k));
  }));
  context.putImageData(image, 0, 0);
  canvas.setAttribute("aria-label", `Attention of layer ${layer}, head ${$("attention-head").value}: ${size} by ${size}; arrow keys move between cells`);
  readout();
}

function readout() {
  const matrix = heads(Number($("attention-layer").value))[Number($("attention-head").value)];
  const { row, col } = cursor;
  if (row >= matrix.length || col >= matrix.length) return;
  const tokens = current.tokens;
  const marker = $("attention-cursor"); // where the readout points, in percent of the heatmap
  Object.assign(marker.style, {
    left: `${(100 * col) / matrix.length}%`, top: `${(100 * row) / matrix.length}%`,
    width: `${100 / matrix.length}%`, height: `${100 / matrix.length}%`,
  });
  marker.hidden = false;
  $("attention-readout").textContent =
    `query ${row} ${visible(tokens[row])} \u2192 key ${col} ${visible(tokens[col])}: ${matrix[row][col].toFixed(4)}`;
}

async function showLayer() {
  const layer = Number($("attention-layer").value);
  if (!heads(layer)) {
    const answer = await getJson("/analyze/attention", { text: current.text, layers: [layer], ...withAdapter() });
    current.attention.set(layer, answer.layers[0].attention);
    current.tokens = answer.tokens;
  }
  drawAttention();
}

// --- logit lens ------------------------------------------------------------------------------

function drawLens(answer) {
  const table = $("lens");
  table.replaceChildren();
  const head = table.createTHead().insertRow();
  const corner = document.createElement("th");
  corner.textContent = "layer \\ input";
  head.append(corner);
  for (const token of answer.tokens) {
    const th = document.createElement("th");
    th.scope = "col";
    th.textContent = visible(token);
    head.append(th);
  }
  const body = table.createTBody();
  for (const layer of answer.layers) {
    const row = body.insertRow();
    const th = document.createElement("th");
    th.scope = "row";
    th.textContent = layer.layer === 0 ? "0 emb" : String(layer.layer);
    row.append(th);
    for (const top of layer.top) {
      const cell = row.insertCell();
      cell.textContent = visible(top[0].text);
      cell.dataset.id = top[0].id;
      cell.style.backgroundColor = probabilityColour(top[0].logprob);
      cell.title = top.map((t) => `${visible(t.text)} ${percent(t.logprob)}`).join("\n");
    }
  }
}

// --- the view -----------------------------------------------------------------------------------

// The adapter part of a request body: nothing for the base model.
function withAdapter() {
  return current.adapter ? { adapter: current.adapter } : {};
}

export async function inspect() {
  const text = $("inspect-text").value;
  const error = $("inspect-error");
  const status = $("inspect-status");
  clearError(error);
  current = { text, adapter: $("inspect-adapter").value || null, attention: new Map(), tokens: [] };
  cursor = { row: 0, col: 0 };
  $("inspect").disabled = true;
  try {
    status.textContent = "measuring spectral norms…";
    drawSpectrum(await getJson("/analyze/spectrum", { texts: [text], ...withAdapter(), ...(current.adapter ? { compare: "base" } : {}) }));
    status.textContent = "reading attention…";
    await showLayer();
    status.textContent = "reading the logit lens…";
    drawLens(await getJson("/analyze/logit-lens", { text, top_k: LENS_TOP_K, ...withAdapter() }));
    status.textContent = `${current.tokens.length} tokens inspected`;
  } catch (failure) {
    status.textContent = "";
    showError(error, failure);
  } finally {
    $("inspect").disabled = false;
  }
}

function moveCursor(event) {
  const matrix = current.text !== null && heads(Number($("attention-layer").value));
  if (!matrix) return;
  const size = matrix[0].length;
  const moves = { ArrowUp: [-1, 0], ArrowDown: [1, 0], ArrowLeft: [0, -1], ArrowRight: [0, 1] };
  const move = moves[event.key];
  if (!move) return;
  event.preventDefault();
  cursor = { row: Math.min(size - 1, Math.max(0, cursor.row + move[0])), col: Math.min(size - 1, Math.max(0, cursor.col + move[1])) };
  readout();
}

export function setUpInspect() {
  // Adapters are loaded and unloaded at run time: the list is read again whenever it is opened.
  $("inspect-adapter").addEventListener("focus", refreshAdapters);
  $("inspect-form").addEventListener("submit", (event) => {
    event.preventDefault();
    inspect();
  });
  const redraw = (fetchLayer) => async () => {
    if (current.text === null) return;
    try {
      await (fetchLayer ? showLayer() : drawAttention());
    } catch (failure) {
      showError($("inspect-error"), failure);
    }
  };
  $("attention-layer").addEventListener("change", redraw(true));
  $("attention-head").addEventListener("change", redraw(false));
  const canvas = $("attention");
  canvas.addEventListener("keydown", moveCursor);
  canvas.addEventListener("mousemove", (event) => {
    const matrix = current.text !== null && heads(Number($("attention-layer").value));
    if (!matrix) return;
    const box = canvas.getBoundingClientRect();
    const size = canvas.width;
    cursor = {
      row: Math.min(size - 1, Math.max(0, Math.floor(((event.clientY - box.top) / box.height) * size))),
      col: Math.min(size - 1, Math.max(0, Math.floor(((event.clientX - box.left) / box.width) * size))),
    };
    readout();
  });
}
