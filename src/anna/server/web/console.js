// Anna's web console: a chat over /v1/chat/completions (streamed) and a live view of the engine
// from GET /snapshot, polled every second. No framework, no network beyond this server. The API
// key, where the server has one, lives in this page's memory only: a reload forgets it.
"use strict";

const state = {
  apiKey: "",
  model: null,
  history: [],        // the conversation as chat messages
  abort: null,        // the AbortController of the request streaming now
  samples: [],        // recent snapshots, oldest first, for rates and charts
  lastSpikes: null,
};
const HISTORY_SECONDS = 120;
const $ = (id) => document.getElementById(id);

function headers(extra = {}) {
  const h = { ...extra };
  if (state.apiKey) h["Authorization"] = "Bearer " + state.apiKey;
  return h;
}

function setStatus(text, bad = false) {
  const el = $("status");
  el.textContent = text;
  el.classList.toggle("bad", bad);
}

async function errorText(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch (e) {
    return response.status + " " + response.statusText;
  }
}

// ---------------------------------------------------------------- tabs and login

for (const tab of document.querySelectorAll(".tab")) {
  tab.addEventListener("click", () => {
    for (const t of document.querySelectorAll(".tab")) t.classList.toggle("active", t === tab);
    for (const p of document.querySelectorAll(".panel")) p.classList.toggle("hidden", p.id !== "panel-" + tab.dataset.panel);
  });
}

$("login").addEventListener("submit", (event) => {
  event.preventDefault();
  state.apiKey = $("api-key").value.trim();
  state.model = null;
  poll();
});

async function loadModel() {
  const response = await fetch("/v1/models", { headers: headers() });
  if (!response.ok) throw new Error(await errorText(response));
  const body = await response.json();
  state.model = body.data[0].id;
  $("model").textContent = state.model;
}

// ---------------------------------------------------------------- chat

function addMessage(role, text) {
  const el = document.createElement("div");
  el.className = "msg " + role;
  if (role === "assistant") {
    el.innerHTML = '<details class="reasoning hidden" open><summary>reasoning</summary><div class="reasoning-text"></div></details>' +
      '<div class="answer"></div><div class="figures"></div>';
  } else {
    el.textContent = text;
  }
  $("messages").appendChild(el);
  el.scrollIntoView({ block: "end" });
  return el;
}

function numberOrNull(id) {
  const v = $(id).value.trim();
  return v === "" ? null : Number(v);
}

async function send(text) {
  if (!state.model) await loadModel();
  state.history.push({ role: "user", content: text });
  addMessage("user", text);
  const el = addMessage("assistant");
  const answer = el.querySelector(".answer"), reasoning = el.querySelector(".reasoning-text");
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...state.history);
  const body = { model: state.model, messages, stream: true, stream_options: { include_usage: true },
                 temperature: numberOrNull("temperature"), top_p: numberOrNull("top_p"),
                 max_tokens: numberOrNull("max_tokens") };
  const seed = numberOrNull("seed");
  if (seed !== null) body.seed = seed;
  state.abort = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  const started = performance.now();
  let first = null, usage = null, finish = null, text_ = "", thought = "";
  // The text is shown at most once per frame, whatever the token rate: a long answer must not
  // make the page (and its Stop button) slow to respond.
  let painting = false;
  const paint = () => {
    painting = false;
    if (thought) {
      reasoning.parentElement.classList.remove("hidden");
      reasoning.textContent = thought;
    }
    answer.textContent = text_;
    el.scrollIntoView({ block: "end" });
  };
  const schedulePaint = () => {
    if (!painting) { painting = true; requestAnimationFrame(paint); }
  };
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers({ "Content-Type": "application/json" }), body: JSON.stringify(body),
      signal: state.abort.signal });
    if (!response.ok) throw new Error(await errorText(response));
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) !== -1) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        if (!event.startsWith("data: ")) continue;
        const data = event.slice(6);
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          const delta = choice.delta || {};
          if (delta.reasoning_content) {
            first = first ?? performance.now();
            thought += delta.reasoning_content;
          }
          if (delta.content) {
            first = first ?? performance.now();
            text_ += delta.content;
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
        schedulePaint();
      }
    }
  } catch (error) {
    if (error.name === "AbortError") {
      finish = "stopped";
    } else {
      const err = document.createElement("div");
      err.className = "error";
      err.textContent = "Error: " + error.message;
      el.appendChild(err);
      finish = "error";
    }
  } finally {
    state.abort = null;
    $("send").disabled = false;
    $("stop").disabled = true;
    paint();
  }
  state.history.push({ role: "assistant", content: text_ });
  const ended = performance.now();
  const parts = [];
  if (first !== null) parts.push("TTFT " + Math.round(first - started) + " ms");
  if (usage) {
    const seconds = (ended - (first ?? started)) / 1000;
    if (usage.completion_tokens > 1 && seconds > 0) parts.push(((usage.completion_tokens - 1) / seconds).toFixed(1) + " tokens/s");
    parts.push(usage.completion_tokens + " tokens");
    const cached = usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : 0;
    parts.push(cached + " of " + usage.prompt_tokens + " prompt tokens cached");
  }
  if (finish) parts.push(finish);
  el.querySelector(".figures").textContent = parts.join(" · ");
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.abort) return;
  $("prompt").value = "";
  send(text).catch((error) => setStatus(error.message, true));
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => { if (state.abort) state.abort.abort(); });
$("clear").addEventListener("click", () => {
  if (state.abort) state.abort.abort();
  state.history = [];
  $("messages").innerHTML = "";
});

// ---------------------------------------------------------------- live engine view

const COLORS = ["#2f6fde", "#e0762b", "#2a9d6f", "#8a55c9"];
const STEP_CLASSES = ["pure", "+prefill_insert", "+budget_recompute", "prefill_only"];

function drawChart(canvas, series, { percent = false, markers = [] } = {}) {
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height, pad = 28;
  ctx.clearRect(0, 0, w, h);
  const now = Date.now() / 1000;
  let max = percent ? 100 : 0;
  for (const s of series) for (const [, v] of s) if (v !== null && v > max) max = v;
  max = max > 0 ? max * (percent ? 1 : 1.15) : 1;
  const x = (t) => pad + (w - pad - 4) * (1 - (now - t) / HISTORY_SECONDS);
  const y = (v) => h - 16 - (h - 24) * (v / max);
  ctx.strokeStyle = "#dde1ea";
  ctx.fillStyle = "#6b7385";
  ctx.font = "10px system-ui";
  ctx.lineWidth = 1;
  for (const f of [0, 0.5, 1]) {
    ctx.beginPath(); ctx.moveTo(pad, y(max * f)); ctx.lineTo(w - 4, y(max * f)); ctx.stroke();
    ctx.fillText((max * f).toFixed(max * f >= 10 || f === 0 ? 0 : 1), 2, y(max * f) + 3);
  }
  ctx.fillText("-" + HISTORY_SECONDS + " s", pad, h - 3);
  ctx.fillText("now", w - 24, h - 3);
  ctx.strokeStyle = "#c9302c";
  for (const t of markers) { ctx.beginPath(); ctx.moveTo(x(t), 6); ctx.lineTo(x(t), h - 16); ctx.stroke(); }
  series.forEach((points, i) => {
    ctx.strokeStyle = COLORS[i % COLORS.length];
    ctx.lineWidth = 2;
    ctx.beginPath();
    let drawing = false;
    for (const [t, v] of points) {
      if (v === null) { drawing = false; continue; }
      if (drawing) ctx.lineTo(x(t), y(v)); else ctx.moveTo(x(t), y(v));
      drawing = true;
    }
    ctx.stroke();
  });
}

function rates(a, b) {
  const dt = b.time - a.time;
  return dt > 0 ? [(b.tokens.prompt - a.tokens.prompt) / dt, (b.tokens.generation - a.tokens.generation) / dt] : [0, 0];
}

function render() {
  const samples = state.samples;
  const last = samples[samples.length - 1];
  $("running").textContent = last.requests.running;
  $("waiting").textContent = last.requests.waiting;
  const kv = last.kv_cache;
  $("kv").textContent = kv.used + " / " + kv.cached + " / " + kv.blocks;
  const pc = last.prefix_cache;
  $("prefix").textContent = pc.hit_rate === null ? "–" : (100 * pc.hit_rate).toFixed(1) + "%";
  $("releases").textContent = last.memory.releases + " · " + (last.memory.kv_resident_bytes / 2 ** 20).toFixed(0) + " MiB";
  $("spikes").textContent = last.steps.spikes;
  const pairs = samples.slice(1).map((s, i) => [s.time, rates(samples[i], s)]);
  if (pairs.length) {
    const [rin, rout] = pairs[pairs.length - 1][1];
    $("rate-in").textContent = rin.toFixed(1);
    $("rate-out").textContent = rout.toFixed(1);
  }
  drawChart($("chart-tokens"), [pairs.map(([t, r]) => [t, r[0]]), pairs.map(([t, r]) => [t, r[1]])]);
  drawChart($("chart-requests"), [samples.map((s) => [s.time, s.requests.running]),
                                  samples.map((s) => [s.time, s.requests.waiting])]);
  drawChart($("chart-kv"), [samples.map((s) => [s.time, 100 * s.kv_cache.used / s.kv_cache.blocks]),
                            samples.map((s) => [s.time, 100 * s.kv_cache.cached / s.kv_cache.blocks])], { percent: true });
  const spikes = samples.slice(1).filter((s, i) => s.steps.spikes > samples[i].steps.spikes).map((s) => s.time);
  drawChart($("chart-steps"), STEP_CLASSES.map((c) => samples.map((s) => [s.time, s.steps.classes[c].mean_ms])),
            { markers: spikes });
}

function renderSettings(settings) {
  const body = $("settings").querySelector("tbody");
  if (body.childElementCount === settings.length) return;
  body.innerHTML = "";
  for (const { name, value, source } of settings) {
    const row = body.insertRow();
    row.insertCell().textContent = name;
    row.insertCell().textContent = JSON.stringify(value);
    const cell = row.insertCell();
    cell.textContent = source;
    cell.className = "source-" + source.split(/[ :]/)[0];
  }
}

async function poll() {
  try {
    const response = await fetch("/snapshot", { headers: headers() });
    if (response.status === 401) {
      setStatus(state.apiKey ? "API key refused" : "API key needed", true);
      return;
    }
    if (!response.ok) {
      setStatus(await errorText(response), true);
      return;
    }
    const snap = await response.json();
    if (!state.model) {
      state.model = snap.model;
      $("model").textContent = snap.model;
    }
    state.samples.push(snap);
    while (state.samples.length && snap.time - state.samples[0].time > HISTORY_SECONDS) state.samples.shift();
    setStatus("live · " + new Date(snap.time * 1000).toLocaleTimeString());
    renderSettings(snap.settings);
    render();
  } catch (error) {
    setStatus("server unreachable", true);
  }
}

poll();
setInterval(poll, 1000);
