// The page of a statistics record (attnkit.record_stats): summaries per layer x head, and one head's queries.
(function () {
  const D = JSON.parse(document.getElementById("attnkit-data").textContent);
  const $ = (id) => document.getElementById(id);
  const decoded = new Map();
  function blob(id) {
    let bytes = decoded.get(id);
    if (bytes === undefined) {
      const s = atob(D.blobs[id]);
      bytes = new Uint8Array(s.length);
      for (let i = 0; i < s.length; i++) bytes[i] = s.charCodeAt(i);
      decoded.set(id, bytes);
    }
    return bytes;
  }
  function floats(series) {
    const bytes = blob(series.data);
    return new Float32Array(bytes.buffer, bytes.byteOffset, bytes.length / 4);
  }
  const S = { layer: 0, head: 0, step: 0, query: -1 }; // query -1: the call's last (a prompt's answer position)
  const steps = Math.max(...D.layers.map((l) => l.calls.length));
  const callOf = (l) => D.layers[l].calls[Math.min(S.step, D.layers[l].calls.length - 1)];
  const MEASURES = [["entropy", "entropy"], ["sink", "sink mass"], ["distance", "distance"]];

  function fmt(x) { return Math.abs(x) >= 100 ? x.toFixed(0) : x.toPrecision(3); }
  function shade(t) { const c = Math.round(255 - 200 * Math.max(0, Math.min(1, t))); return `rgb(${c},${c},255)`; }
  const ink = (t) => (t > 0.55 ? "#fff" : "#000"); // text that stays legible on a dark cell

  // One scale per measure, shared by every layer and head and fixed by what the measure can be, not by the values
  // shown (8.00 and 8.01 nats look alike): entropy from 0 to ln(keys), the most a row over the record's widest call
  // can have; sink mass from 0 to 1; distance from 0 to the widest call's keys.
  const widest = Math.max(1, ...D.layers.flatMap((l) => l.calls.map((c) => c.lk)));
  const SCALES = { entropy: [0, Math.log(widest)], sink: [0, 1], distance: [0, widest] };
  // What a head is called on the page, by its averages (said under the tables): its weight mostly on the first keys,
  // or on a few keys (exp(entropy), the keys a row spreads over as if evenly, at most SHARP_KEYS), or on many (at
  // least DIFFUSE_SHARE of its call's keys).
  const SINK_SHARE = 0.5, SHARP_KEYS = 4, DIFFUSE_SHARE = 0.1;
  function kindOf(call, h) {
    const m = call.summary;
    if (m.sink[h] >= SINK_SHARE) return "sink";
    const keys = Math.exp(m.entropy[h]);
    if (keys <= SHARP_KEYS) return "sharp";
    return keys >= DIFFUSE_SHARE * call.lk ? "diffuse" : "";
  }

  function renderTables() {
    const box = $("st-tables");
    box.textContent = "";
    for (const [key, label] of MEASURES) {
      const table = document.createElement("table");
      table.className = "st-grid";
      const values = D.layers.map((l, i) => callOf(i).summary[key]);
      const [lo, hi] = SCALES[key];
      const caption = table.createCaption();
      caption.className = "st-scale";
      caption.textContent = `${label}: ${fmt(lo)} `;
      const bar = document.createElement("span");
      bar.className = "st-bar";
      caption.appendChild(bar);
      caption.append(` ${fmt(hi)}${key === "entropy" ? ` (ln ${widest} keys)` : ""}`);
      const head = table.insertRow();
      const th = (row, text) => { const cell = document.createElement("th"); cell.textContent = text; row.appendChild(cell); };
      th(head, label); // text, never markup: a layer's name comes from the model or a saved file
      const H = Math.max(...D.layers.map((l) => l.heads));
      for (let h = 0; h < H; h++) th(head, `h${h}`);
      D.layers.forEach((layer, l) => {
        const row = table.insertRow();
        th(row, layer.name);
        values[l].forEach((v, h) => {
          const cell = row.insertCell();
          cell.textContent = fmt(v);
          const t = hi > lo ? (v - lo) / (hi - lo) : 0;
          cell.style.background = shade(t);
          cell.style.color = ink(t);
          cell.title = `${layer.name}, head ${h}: ${label} ${v}`;
          if (l === S.layer && h === S.head) cell.className = "chosen";
          cell.addEventListener("click", () => { S.layer = l; S.head = h; render(); });
        });
      });
      box.appendChild(table);
    }
    const kinds = document.createElement("table"); // each head's kind, by the thresholds said below
    kinds.className = "st-grid st-kinds";
    const head = kinds.insertRow();
    const th = (row, text) => { const cell = document.createElement("th"); cell.textContent = text; row.appendChild(cell); };
    th(head, "kind");
    const H = Math.max(...D.layers.map((l) => l.heads));
    for (let h = 0; h < H; h++) th(head, `h${h}`);
    D.layers.forEach((layer, l) => {
      const row = kinds.insertRow();
      th(row, layer.name);
      for (let h = 0; h < layer.heads; h++) {
        const cell = row.insertCell();
        cell.textContent = kindOf(callOf(l), h);
        cell.addEventListener("click", () => { S.layer = l; S.head = h; render(); });
      }
    });
    box.appendChild(kinds);
    $("st-kinds-note").textContent = `kind: sink, at least ${SINK_SHARE * 100}% of the weight on the first keys; ` +
      `sharp, spread over at most ${SHARP_KEYS} keys (exp(entropy)); diffuse, over at least ${DIFFUSE_SHARE * 100}% ` +
      "of its call's keys; blank, between.";
  }

  function fit(canvas) {
    const r = canvas.getBoundingClientRect(), dpr = window.devicePixelRatio || 1;
    canvas.width = Math.max(1, Math.round(r.width * dpr));
    canvas.height = Math.max(1, Math.round(r.height * dpr));
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, r.width, r.height);
    return [ctx, r.width, r.height];
  }

  // A series along the queries or the keys; `log`: on a log scale from hi / 1e6 (column sums span decades).
  // `over`: drawn over the canvas's first series, on its scale (`range`), its label at the right, not on the first's;
  // `name`: what its label calls it (two series on one canvas).
  function plot(canvas, series, head, color, mark, over, log, range, name) {
    const [ctx, w, h] = over ? [canvas.getContext("2d"), canvas.getBoundingClientRect().width, canvas.getBoundingClientRect().height] : fit(canvas);
    const all = floats(series), n = series.n, row = all.subarray(head * n, head * n + n);
    let hi = 0;
    for (const v of row) hi = Math.max(hi, v);
    const top = range ? range[1] : hi, bottom = log ? (range ? range[0] : top / 1e6) : 0;
    const at = (v) => {
      if (!top) return 0;
      if (!log) return v / top;
      return v <= bottom ? 0 : Math.log(v / bottom) / Math.log(top / bottom);
    };
    ctx.strokeStyle = color;
    ctx.beginPath();
    // (a band at the top for the labels, one at the bottom for the axis: neither drawn over by a line)
    row.forEach((v, i) => { const x = (i + 0.5) / n * w, y = h - 14 - at(v) * (h - 32); i ? ctx.lineTo(x, y) : ctx.moveTo(x, y); });
    ctx.stroke();
    ctx.fillStyle = "#333";
    ctx.font = "11px sans-serif";
    ctx.textAlign = over ? "right" : "left";
    ctx.fillText(`${name ? `${name}, ` : ""}max ${fmt(hi)}${log && !over ? ` (log scale, to ${fmt(bottom)})` : ""}`, over ? w - 4 : 4, 12);
    ctx.textAlign = "left";
    if (mark !== undefined) { ctx.strokeStyle = "#c00"; ctx.beginPath(); ctx.moveTo(mark * w, 0); ctx.lineTo(mark * w, h); ctx.stroke(); }
    return [ctx, w, h, [bottom, top]];
  }

  function axis(ctx, w, h, what, n) { // the x axis named, its ends numbered
    ctx.fillStyle = "#555";
    ctx.font = "11px sans-serif";
    ctx.textAlign = "left";
    ctx.fillText("0", 2, h - 2);
    ctx.textAlign = "center";
    ctx.fillText(what, w / 2, h - 2);
    ctx.textAlign = "right";
    ctx.fillText(String(Math.max(0, n - 1)), w - 2, h - 2);
    ctx.textAlign = "left";
  }

  // Each call's strongest keys, deflated by the page's maker (attnkit/viewer/_stats.py, _top), inflated once when
  // first shown: byte planes of uint32 codes (0: no key, else 1 + the zigzagged pos(i) - key), then the weights.
  const inflated = new Map(), inflating = new Map(); // id -> bytes; id -> the promise of them (one inflation each)
  function inflate(id) {
    if (!inflating.has(id)) {
      const stream = new Blob([blob(id)]).stream().pipeThrough(new DecompressionStream("deflate"));
      inflating.set(id, new Response(stream).arrayBuffer().then((buffer) => {
        const bytes = new Uint8Array(buffer);
        inflated.set(id, bytes);
        return bytes;
      }));
    }
    return inflating.get(id);
  }

  function topOf(bytes, call, H, head, q) {
    const k = D.k, lq = call.lq, cells = H * lq * k;
    const out = [];
    for (let e = 0; e < k; e++) {
      const at = (head * lq + q) * k + e;
      const code = bytes[at] + bytes[cells + at] * 256 + bytes[2 * cells + at] * 65536 + bytes[3 * cells + at] * 16777216;
      if (code === 0) continue; // a weight of 0: no key
      const z = code - 1, offset = z % 2 === 0 ? z / 2 : -(z + 1) / 2; // pos(i) - key
      out.push([q + call.lk - call.lq - offset, bytes[4 * cells + at] / 255]);
    }
    return out;
  }

  let tickets = 0; // a newer view supersedes one still inflating
  function renderQuery() {
    const layer = D.layers[S.layer], call = callOf(S.layer), head = S.head;
    if (S.query < 0) S.query = call.lq - 1; // (the last query, until one is chosen)
    S.query = Math.max(0, Math.min(call.lq - 1, S.query));
    $("st-query").max = String(call.lq - 1);
    $("st-query").value = String(S.query);
    $("st-heading").textContent = `${layer.name}, head ${head}` + (layer.kv ? ` (key/value head ${Math.floor(head / (layer.heads / layer.kv))})` : "") + ` — ${call.lq} queries, ${call.lk} keys`;
    const measure = $("st-measure").value;
    const [sctx, sw, sh] = plot($("st-series"), call.series[measure], head, "#08306b", (S.query + 0.5) / call.lq);
    axis(sctx, sw, sh, `queries (the chosen one in red: ${S.query})`, call.lq);
    const grey = plot($("st-received"), call.series.receivedMax, head, "#bbb", undefined, false, true, undefined, "grey");
    const [ctx, w, h] = plot($("st-received"), call.series.received, head, "#08306b", undefined, true, true, grey[3], "black");
    axis(ctx, w, h, "keys", call.lk);
    const ticket = ++tickets, query = S.query, shown = `${S.layer} ${head} ${query}`;
    const draw = (bytes) => { if (ticket === tickets) drawKeys(ctx, w, h, topOf(bytes, call, layer.heads, head, query), call, query, shown); };
    if (call.lq === 0) { keysNote("This call has no queries."); return Promise.resolve(); }
    const bytes = inflated.get(call.top);
    if (bytes) { draw(bytes); return Promise.resolve(); } // shown at once: no wait for a call already inflated
    keysNote(`query ${query}: inflating this call's strongest keys…`);
    if (typeof DecompressionStream === "undefined") {
      keysNote("This browser cannot inflate the page's strongest keys (it lacks DecompressionStream: Chrome 80, Firefox 113, Safari 16.4 or later can); the summaries and series above are whole.");
      return Promise.resolve();
    }
    return inflate(call.top).then(draw, (error) => keysNote(`The strongest keys could not be inflated: ${error}`));
  }

  function keysNote(text) { // the key list replaced by a line of text: no keys of another view stay listed
    const box = $("st-keys");
    box.textContent = "";
    delete box.dataset.shown;
    const line = document.createElement("div");
    line.textContent = text;
    box.appendChild(line);
  }

  // Where a call's queries and keys stand: given for a cache's rows (blob of int32), else i + Lk - Lq and j.
  function positions(id) { const b = blob(id); return new Int32Array(b.buffer, b.byteOffset, b.length / 4); }
  const queryAt = (call, q) => (call.qpos !== null ? positions(call.qpos)[q] : q + call.lk - call.lq);
  const keyAt = (call, j) => (call.kpos !== null ? positions(call.kpos)[j] : j);

  function drawKeys(ctx, w, h, top, call, query, shown) {
    const at = queryAt(call, query); // the query's own key: the slot holding its position, where slots are known
    const own = call.kpos !== null ? positions(call.kpos).indexOf(at) : at;
    const slot = own >= 0 && own < call.lk ? own : query + call.lk - call.lq;
    const qx = (slot + 0.5) / call.lk * w;
    ctx.strokeStyle = "#c00";
    for (const [key, weight] of top) {
      ctx.globalAlpha = Math.max(0.15, weight);
      ctx.beginPath(); ctx.moveTo(qx, h); ctx.lineTo((key + 0.5) / call.lk * w, 0); ctx.stroke();
    }
    ctx.globalAlpha = 1;
    const tok = (j) => (D.tokens && j < D.tokens.length ? ` ${JSON.stringify(D.tokens[j])}` : "");
    const lines = top.map(([key, weight]) => {
      const p = keyAt(call, key); // a sliding cache's slot holds a position of its own
      return `key ${p}${p !== key ? ` (slot ${key})` : ""}${tok(p)}: ${weight.toFixed(3)}`;
    });
    $("st-keys").textContent = "";
    const title = document.createElement("div");
    title.textContent = `query ${query}${tok(at)}: its ${D.k} strongest keys` + (lines.length ? "" : " (it sees none)");
    $("st-keys").appendChild(title);
    for (const line of lines) { const div = document.createElement("div"); div.textContent = line; $("st-keys").appendChild(div); }
    $("st-keys").dataset.shown = shown; // layer, head and query of the keys listed (for tests and benchmarks)
    $("st-keys").dataset.querySlot = String(slot); // the key slot its lines start from
  }

  // What attnkit.rollout found (each target's relevance over the positions, log scale) and what
  // attnkit.head_sweep measured (a layer x head table of logit changes, red lower, blue higher), when given.
  function renderRollout() {
    const R = D.rollout;
    $("rollout-view").hidden = !R;
    if (!R) return;
    const box = $("rollout-charts");
    box.textContent = "";
    R.targets.forEach((target, i) => {
      const title = document.createElement("div");
      const tok = D.tokens && target < D.tokens.length ? ` ${JSON.stringify(D.tokens[target])}` : "";
      const row = floats({ data: R.relevance[i] });
      let first = 0;
      for (let j = 1; j < row.length; j++) if (row[j] > row[first]) first = j;
      title.textContent = `target position ${target}${tok}: the most relevant position is ${first} (${fmt(row[first])})`;
      box.appendChild(title);
      const canvas = document.createElement("canvas");
      canvas.className = "st-chart";
      box.appendChild(canvas);
      const [ctx, w, h] = plot(canvas, { data: R.relevance[i], n: R.n }, 0, "#08306b", (target + 0.5) / R.n, false, true, undefined, "relevance");
      axis(ctx, w, h, "positions (the target in red)", R.n);
    });
    $("rollout-note").textContent = `r <- r ((1 - ${R.residual}) A + ${R.residual} I) from the last layer to the first, ` +
      `A the layer's weights, ${R.heads === "mean" ? "averaged over its heads" : "their largest over the heads, rows scaled to sum to 1"}.`;
  }

  function renderSweep() {
    const W = D.sweep;
    $("sweep-view").hidden = !W;
    if (!W) return;
    const table = document.createElement("table");
    table.className = "st-grid";
    const biggest = Math.max(1e-12, ...W.change.flat().map(Math.abs));
    const caption = table.createCaption();
    caption.className = "st-scale";
    caption.textContent = `logit change (the logit without: ${fmt(W.base)}): -${fmt(biggest)} red, 0 white, +${fmt(biggest)} blue`;
    const th = (row, text) => { const cell = document.createElement("th"); cell.textContent = text; row.appendChild(cell); };
    const head = table.insertRow();
    th(head, "head ablated");
    const H = Math.max(...W.change.map((r) => r.length));
    for (let h = 0; h < H; h++) th(head, `h${h}`);
    W.names.forEach((name, l) => {
      const row = table.insertRow();
      th(row, name);
      W.change[l].forEach((v) => {
        const cell = row.insertCell();
        cell.textContent = fmt(v);
        const t = Math.min(1, Math.abs(v) / biggest), c = Math.round(255 - 200 * t);
        cell.style.background = v < 0 ? `rgb(255,${c},${c})` : `rgb(${c},${c},255)`;
        cell.style.color = ink(t);
      });
    });
    $("sweep-table").textContent = "";
    $("sweep-table").appendChild(table);
  }

  function render() { renderTables(); return renderQuery(); }

  const notes = $("notes");
  for (const note of D.notes) { const li = document.createElement("li"); li.textContent = note; notes.appendChild(li); }
  if (steps > 1) {
    $("step-box").hidden = false;
    $("step").max = String(steps - 1);
    // counted from 0, as the weights page and its URL's step= count (0: the first call)
    $("step").addEventListener("input", () => { S.step = Number($("step").value); $("step-label").textContent = `step ${S.step} of ${steps - 1}`; render(); });
    $("step-label").textContent = `step 0 of ${steps - 1}`;
  }
  $("st-measure").addEventListener("change", renderQuery);
  $("st-query").addEventListener("change", () => { S.query = Number($("st-query").value) || 0; renderQuery(); });
  $("st-series").addEventListener("click", (e) => {
    const r = e.target.getBoundingClientRect();
    S.query = Math.floor((e.clientX - r.left) / r.width * callOf(S.layer).lq);
    renderQuery();
  });
  window.addEventListener("resize", () => { renderQuery(); renderRollout(); });
  renderRollout();
  renderSweep();
  render().then(() => { document.documentElement.dataset.ready = "1"; });
})();
