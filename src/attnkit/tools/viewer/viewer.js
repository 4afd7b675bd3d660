// attnkit view: the page's whole program. No library, no request: it reads the JSON in #attnkit-data (made by
// attnkit/viewer/_data.py) and draws three views of it. A call's weights come in one of three encodings:
//   f32   (H, Lq, Lk) float32, every weight as it is (a weight of exactly 0 is masked);
//   u8    (H, Lq, Lk) uint8, weight = code * scale / 255, masks from bitmaps;
//   topk  (H, Lq, kc) uint16 key positions, then (H, Lq, kc) uint8 codes, then (H, Lq) uint8 codes of each row's
//         kc-th largest weight (what was not kept is below it), masks from bitmaps.
// A mask bitmap is (Lq, Lk) bits, little-endian within each byte, set where the weight is exactly 0.
"use strict";
(function () {
  const D = JSON.parse(document.getElementById("attnkit-data").textContent);
  const $ = (id) => document.getElementById(id);
  const ROW = 18; // px per token in the head view, at least (taller when the tokens leave room: up to ROW_MAX)
  const ROW_MAX = 40;
  const LINE_MIN = 0.01; // weights under this draw no line
  const LEVELS = 24; // line opacities are drawn in this many steps, one path each
  const MAX_LINES = 5000; // the head view draws at most this many lines (the strongest)
  const LINES_MIN_W = 200; // px between the token columns, at least (the lines take the room the tokens leave)
  const AVERAGE = [20, 50, 110]; // the colour of the average mode's lines
  const AVERAGE_FROM = 5; // a page whose layers have this many heads or more opens in the average mode
  const HATCH = [200, 236]; // the two greys of the masked stripes
  const BLUE = [8, 48, 107]; // the colour of a matrix's largest weight (white is 0)

  // ------------------------------------------------------------------------------------------ data
  const decoded = new Map();
  function blob(id) {
    let bytes = decoded.get(id);
    if (bytes === undefined) {
      const text = D.blobs[id];
      if (typeof Uint8Array.fromBase64 === "function") {
        bytes = Uint8Array.fromBase64(text);
      } else {
        const s = atob(text);
        bytes = new Uint8Array(s.length);
        for (let i = 0; i < s.length; i++) bytes[i] = s.charCodeAt(i);
      }
      decoded.set(id, bytes);
    }
    return bytes;
  }

  function flags(ranges, n) {
    const out = new Uint8Array(n);
    for (const [a, b] of ranges) out.fill(1, a, b);
    return out;
  }

  // One call of one layer: its weights, masks, padding and tokens, decoded when first asked for.
  class Matrix {
    constructor(layer, call) {
      this.layer = layer;
      this.call = call;
      this.H = layer.heads;
      this.lq = call.lq;
      this.lk = call.lk;
      const b = blob(call.data); // a fresh buffer: offset 0, aligned for any view
      const rows = this.H * this.lq;
      if (call.enc === "f32") {
        this.f = new Float32Array(b.buffer, b.byteOffset, rows * this.lk);
      } else if (call.enc === "u8") {
        this.u = b;
      } else {
        this.kc = call.kc;
        const n = rows * this.kc;
        this.idx = new Uint16Array(b.buffer, b.byteOffset, n);
        this.val = b.subarray(2 * n, 3 * n);
        this.thr = b.subarray(3 * n, 3 * n + rows);
      }
      this.unit = call.scale / 255;
      this.masks = call.masks ? call.masks.map((id) => (id >= 0 ? blob(id) : id)) : null;
      this.padq = flags(call.padq, this.lq);
      this.padk = flags(call.padk, this.lk);
      // query i stands at key position qoff + i when both sides are one sequence (self-attention)
      this.aligned = call.q === call.k && call.qoff + call.lq <= call.lk;
    }
    // fn(j, w) for each weight kept in row i of head h
    row(h, i, fn) {
      const lk = this.lk;
      if (this.f) {
        const o = (h * this.lq + i) * lk;
        for (let j = 0; j < lk; j++) fn(j, this.f[o + j]);
      } else if (this.u) {
        const o = (h * this.lq + i) * lk;
        for (let j = 0; j < lk; j++) fn(j, this.u[o + j] * this.unit);
      } else {
        const o = (h * this.lq + i) * this.kc;
        for (let t = 0; t < this.kc; t++) fn(this.idx[o + t], this.val[o + t] * this.unit);
      }
    }
    // the weight at (h, i, j), or -1 when it was not kept
    value(h, i, j) {
      if (this.f) return this.f[(h * this.lq + i) * this.lk + j];
      if (this.u) return this.u[(h * this.lq + i) * this.lk + j] * this.unit;
      const o = (h * this.lq + i) * this.kc;
      for (let t = 0; t < this.kc; t++) if (this.idx[o + t] === j) return this.val[o + t] * this.unit;
      return -1;
    }
    // the smallest weight kept in row i (what was not kept is below it)
    threshold(h, i) {
      return this.thr ? this.thr[h * this.lq + i] * this.unit : 0;
    }
    masked(h, i, j) {
      if (this.f) return this.f[(h * this.lq + i) * this.lk + j] === 0;
      const m = this.masks[h];
      if (m === -1) return false;
      if (m === -2) return this.value(h, i, j) === 0; // not known: as the exact encodings read it
      const n = i * this.lk + j;
      return ((m[n >> 3] >> (n & 7)) & 1) === 1;
    }
    qPos(i) {
      return this.call.qoff + i;
    }
    qLabel(i) {
      return this.call.q === null ? String(this.qPos(i)) : D.tokens[this.call.q][this.qPos(i)];
    }
    kLabel(j) {
      return this.call.k === null ? String(j) : D.tokens[this.call.k][j];
    }
  }

  const matrices = new Map();
  function matrix(l, c) {
    const key = l + "/" + c;
    let m = matrices.get(key);
    if (m === undefined) {
      m = new Matrix(D.layers[l], D.layers[l].calls[c]);
      matrices.set(key, m);
    }
    return m;
  }

  // ----------------------------------------------------------------------------------------- state
  const steps = Math.max(...D.layers.map((layer) => layer.calls.length));
  const S = {
    view: "head",
    layer: 0,
    step: 0,
    head: 0,
    hover: null,
    off: D.layers.map(() => new Set()),
    lines: D.heads >= AVERAGE_FROM ? "average" : "heads", // the head view's lines: each head's, or their mean
  };

  function callOf(l) {
    return Math.min(S.step, D.layers[l].calls.length - 1);
  }

  function readHash() {
    const p = new URLSearchParams(location.hash.slice(1));
    const int = (name, n) => {
      const v = parseInt(p.get(name), 10);
      return Number.isInteger(v) && v >= 0 && v < n ? v : null;
    };
    if (["head", "model", "matrix"].includes(p.get("view"))) S.view = p.get("view");
    if (["heads", "average"].includes(p.get("lines"))) S.lines = p.get("lines");
    S.layer = int("layer", D.layers.length) ?? 0;
    S.step = int("step", steps) ?? 0;
    S.head = int("head", D.layers[S.layer].heads) ?? 0;
    const hover = /^([qk])(\d+)$/.exec(p.get("hover") || ""); // a token of the head view, e.g. hover=q3
    if (hover) S.hover = { side: hover[1], i: parseInt(hover[2], 10) };
    for (const h of (p.get("off") || "").split(",")) {
      const v = parseInt(h, 10);
      if (v >= 0 && v < D.layers[S.layer].heads) S.off[S.layer].add(v);
    }
  }

  // --------------------------------------------------------------------------------------- colours
  function hue(layer, h) {
    const H = layer.heads;
    const G = layer.groups;
    if (G > 1 && G < H) {
      const per = H / G;
      const g = Math.floor(h / per);
      const r = h % per;
      return [(g * 360) / G, per > 1 ? 28 + (34 * r) / (per - 1) : 45];
    }
    return [(h * 360) / Math.max(H, 1), 45];
  }
  function headColor(layer, h, alpha) {
    const [hh, light] = hue(layer, h);
    return `hsla(${((hh + 210) % 360).toFixed(0)}, 72%, ${light.toFixed(0)}%, ${alpha})`;
  }
  function shade(t) {
    // white at 0, BLUE at 1
    const c = Math.max(0, Math.min(1, t));
    return [255 + (BLUE[0] - 255) * c, 255 + (BLUE[1] - 255) * c, 255 + (BLUE[2] - 255) * c];
  }
  function fmt(w) {
    return w === 0 ? "0" : w >= 0.001 ? w.toFixed(4) : w.toExponential(2);
  }

  // ---------------------------------------------------------------------------------------- header
  function setupHeader() {
    const select = $("layer");
    D.layers.forEach((layer, l) => {
      const o = document.createElement("option");
      o.value = String(l);
      const kv = layer.groups > 1 && layer.groups < layer.heads ? `, ${layer.groups} kv` : "";
      o.textContent = `${layer.name} (${layer.heads} head${layer.heads > 1 ? "s" : ""}${kv})`;
      select.appendChild(o);
    });
    select.addEventListener("change", () => {
      S.layer = parseInt(select.value, 10);
      S.head = Math.min(S.head, D.layers[S.layer].heads - 1);
      S.hover = null;
      render();
    });
    const step = $("step");
    step.max = String(steps - 1);
    $("step-box").hidden = steps < 2;
    step.addEventListener("input", () => {
      S.step = parseInt(step.value, 10);
      S.hover = null;
      render();
    });
    for (const b of $("tabs").querySelectorAll("button")) {
      b.addEventListener("click", () => {
        S.view = b.dataset.view;
        S.hover = null;
        render();
      });
    }
    for (const b of $("line-mode").querySelectorAll("button")) {
      b.addEventListener("click", () => {
        S.lines = b.dataset.lines;
        renderHeadView();
      });
    }
    for (const note of D.notes) {
      const li = document.createElement("li");
      li.textContent = note;
      $("notes").appendChild(li);
    }
    $("legend").innerHTML =
      '<span class="swatch masked"></span> masked (weight exactly 0) &nbsp; ' +
      '<span style="text-decoration: line-through; color: #999">pad</span> padding: a key no query sees, ' +
      "or a query that sees no key";
  }

  function renderHeader() {
    $("layer").value = String(S.layer);
    $("step").value = String(S.step);
    const layer = D.layers[S.layer];
    const c = callOf(S.layer);
    const m = layer.calls[c];
    const last = c < S.step ? " (this layer's last call)" : "";
    // counted from 0, as the URL's step= counts (0: the first call, a prompt's; its decoding steps from 1)
    $("step-label").textContent = `step ${c} of ${layer.calls.length - 1}: ${m.lq} x ${m.lk}${last}`;
    for (const b of $("tabs").querySelectorAll("button")) b.classList.toggle("active", b.dataset.view === S.view);
    for (const v of ["head", "model", "matrix"]) $(v + "-view").hidden = v !== S.view;
  }

  // Head buttons, grouped by key/value head. chosen(h): drawn as chosen; onHead(h), onGroup(heads) on clicks.
  function headButtons(box, l, state, onHead, onGroup) {
    const layer = D.layers[l];
    box.textContent = "";
    const per = layer.heads / layer.groups;
    for (let g = 0; g < layer.groups; g++) {
      const group = document.createElement("span");
      group.className = "group";
      const heads = [];
      for (let h = g * per; h < (g + 1) * per; h++) heads.push(h);
      if (layer.groups > 1 || onGroup) {
        const label = document.createElement("span");
        label.className = "group-label";
        label.textContent = layer.groups > 1 && layer.groups < layer.heads ? `kv ${g}` : "all";
        label.title = "heads " + heads.join(", ") + (layer.groups > 1 ? ` share key/value head ${g}` : "");
        if (onGroup) label.addEventListener("click", () => onGroup(heads));
        group.appendChild(label);
      }
      for (const h of heads) {
        const b = document.createElement("span");
        b.className = "head " + state(h);
        b.dataset.head = String(h);
        b.textContent = String(h);
        b.style.background = headColor(layer, h, 1);
        b.addEventListener("click", () => onHead(h));
        group.appendChild(b);
      }
      box.appendChild(group);
    }
  }

  // ------------------------------------------------------------------------------------- head view
  let hv = null; // what the head view shows now: {l, c, m, qrow, rows, row, width, ...}

  function renderHeadView() {
    const l = S.layer;
    const off = S.off[l];
    headButtons(
      $("head-toggles"),
      l,
      (h) => (off.has(h) ? "off" : ""),
      (h) => {
        if (off.has(h)) off.delete(h);
        else off.add(h);
        renderHeadView();
      },
      (heads) => {
        const allOn = heads.every((h) => !off.has(h));
        for (const h of heads) {
          if (allOn) off.add(h);
          else off.delete(h);
        }
        renderHeadView();
      },
    );
    for (const b of $("line-mode").querySelectorAll("button")) {
      b.classList.toggle("active", b.dataset.lines === S.lines);
    }
    const c = callOf(l);
    if (!hv || hv.l !== l || hv.c !== c || hv.row !== rowHeight(matrix(l, c))) buildTokens(l, c);
    if (S.hover && S.hover.i >= (S.hover.side === "q" ? hv.m.lq : hv.m.lk)) S.hover = null;
    fitCanvas();
    drawLines();
    highlight();
  }

  function columnWidth(labels) {
    let longest = 1;
    for (const t of labels) longest = Math.max(longest, t.length);
    return Math.min(220, 14 + 7.5 * longest);
  }

  // Rows of ROW px when the tokens do not fit the window's height, else taller (up to ROW_MAX): a few tokens
  // across a wide window would otherwise be joined by lines too flat to follow.
  function rowHeight(m) {
    const rows = Math.max(m.lk, m.aligned ? m.lk : m.lq);
    const top = $("hv-body").getBoundingClientRect().top + window.scrollY;
    const room = Math.min(window.innerHeight - 150, window.innerHeight - top - 24); // 150: as .hv-body's max-height
    return Math.max(ROW, Math.min(ROW_MAX, Math.floor(room / rows)));
  }

  function buildTokens(l, c) {
    const m = matrix(l, c);
    const qcol = $("hv-queries");
    const kcol = $("hv-keys");
    const qrow = (i) => (m.aligned ? m.qPos(i) : i);
    const rows = Math.max(m.lk, m.aligned ? m.lk : m.lq);
    const row = rowHeight(m);
    const make = (col, n, label, pad, side, top) => {
      col.textContent = "";
      const labels = [];
      const frag = document.createDocumentFragment();
      for (let i = 0; i < n; i++) {
        const d = document.createElement("div");
        const text = label(i);
        labels.push(text);
        d.className = "tok" + (pad[i] ? " pad" : "");
        d.textContent = text;
        d.title = `${side === "q" ? "query" : "key"} ${side === "q" ? m.qPos(i) : i}: ${text}`;
        d.style.top = top(i) * row + (row - ROW) / 2 + "px";
        d.dataset.side = side;
        d.dataset.i = String(i);
        frag.appendChild(d);
      }
      col.appendChild(frag);
      col.style.width = columnWidth(labels) + "px";
      col.style.height = rows * row + "px";
    };
    make(qcol, m.lq, (i) => m.qLabel(i), m.padq, "q", qrow);
    make(kcol, m.lk, (j) => m.kLabel(j), m.padk, "k", (j) => j);
    $("hv-track").style.height = rows * row + "px";
    hv = { l, c, m, qrow, rows, row };
  }

  // The canvas is as wide as the room between the token columns and as tall as the part of the head view in sight
  // (at most), and is drawn for what is in sight: a canvas as tall as 1024 tokens took over a second to paint.
  function fitCanvas() {
    const canvas = $("hv-lines");
    const box = $("hv-body");
    const full = hv.rows * hv.row;
    const height = Math.max(hv.row, Math.min(full, box.clientHeight || full));
    const width = Math.max(LINES_MIN_W, $("hv-track").clientWidth);
    const dpr = window.devicePixelRatio || 1;
    if (canvas.height !== Math.round(height * dpr) || canvas.width !== Math.round(width * dpr)) {
      canvas.width = Math.round(width * dpr);
      canvas.height = Math.round(height * dpr);
      canvas.style.width = width + "px";
      canvas.style.height = height + "px";
    }
    hv.dpr = dpr;
    hv.height = height;
    hv.width = width;
  }

  function onTokenHover(e) {
    const t = e.target.closest(".tok");
    if (!t) return;
    const hover = { side: t.dataset.side, i: parseInt(t.dataset.i, 10) };
    if (S.hover && S.hover.side === hover.side && S.hover.i === hover.i) return;
    S.hover = hover;
    drawLines();
    highlight();
  }
  function onTokenLeave() {
    if (S.hover === null) return;
    S.hover = null;
    drawLines();
    highlight();
  }

  function visibleHeads() {
    const heads = [];
    for (let h = 0; h < D.layers[S.layer].heads; h++) if (!S.off[S.layer].has(h)) heads.push(h);
    return heads;
  }

  // fn(i, j, w) for the weights of the hovered token (all of them when none is), per visible head (fn gets the
  // head, h) or, in the average mode, the mean over the visible heads (h = -1; a weight a reduced page did not keep
  // counts as 0).
  function eachWeight(m, hover, fn) {
    const heads = visibleHeads();
    if (S.lines === "heads") {
      for (const h of heads) {
        if (hover && hover.side === "q") {
          m.row(h, hover.i, (j, w) => fn(h, hover.i, j, w));
        } else if (hover) {
          for (let i = 0; i < m.lq; i++) {
            const w = m.value(h, i, hover.i);
            if (w > 0) fn(h, i, hover.i, w);
          }
        } else {
          for (let i = 0; i < m.lq; i++) m.row(h, i, (j, w) => fn(h, i, j, w));
        }
      }
      return;
    }
    if (heads.length === 0) return;
    const n = heads.length;
    if (hover && hover.side === "k") {
      for (let i = 0; i < m.lq; i++) {
        let sum = 0;
        for (const h of heads) sum += Math.max(0, m.value(h, i, hover.i));
        if (sum > 0) fn(-1, i, hover.i, sum / n);
      }
      return;
    }
    const sum = new Float64Array(m.lk);
    const rows = hover ? [hover.i] : Array.from({ length: m.lq }, (_, i) => i);
    for (const i of rows) {
      sum.fill(0);
      for (const h of heads) m.row(h, i, (j, w) => (sum[j] += w));
      for (let j = 0; j < m.lk; j++) if (sum[j] > 0) fn(-1, i, j, sum[j] / n);
    }
  }

  // The lines to draw: (head, i, j, opacity) of every weight (or mean of the heads' weights) whose opacity is
  // LINE_MIN or more, among the hovered token's when one is hovered; past MAX_LINES, only the strongest MAX_LINES
  // (long sequences: a few hundred thousand lines across a canvas thousands of pixels tall take seconds to stroke,
  // and show nothing).
  function chooseLines(m, hover, y0, y1) {
    const norm = Math.max(1, m.call.scale); // opacity = weight (values past 1 are not weights: scaled down)
    const { row } = hv;
    const hs = [];
    const is = [];
    const js = [];
    const as = [];
    eachWeight(m, hover, (h, i, j, w) => {
      const a = w / norm;
      if (a < LINE_MIN) return;
      const yq = hv.qrow(i) * row + row / 2;
      const yk = j * row + row / 2;
      if ((yq < y0 && yk < y0) || (yq > y1 && yk > y1)) return; // out of sight
      hs.push(h);
      is.push(i);
      js.push(j);
      as.push(a);
    });
    let least = 0;
    if (as.length > MAX_LINES) least = Float64Array.from(as).sort()[as.length - MAX_LINES];
    return { hs, is, js, as, least, all: as.length };
  }

  function drawLines() {
    const { m, dpr, qrow, height, width, row } = hv;
    const canvas = $("hv-lines");
    const top = Math.min($("hv-body").scrollTop, hv.rows * row - height); // what is in sight: [top, top + height)
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, -top * dpr);
    ctx.clearRect(0, top, width, height);
    const average = S.lines === "average";
    ctx.lineWidth = average ? 2 : 1.5;
    const { hs, is, js, as, least, all } = chooseLines(m, S.hover, top, top + height);
    const paths = new Map(); // (head + 1) * LEVELS + level -> one path
    const drawn = { heads: [], queries: [], keys: [], weights: [] }; // what was drawn, for a test to read
    let count = 0;
    for (let n = 0; n < as.length; n++) {
      if (as[n] < least || count === MAX_LINES) continue;
      const level = Math.min(LEVELS - 1, Math.floor(as[n] * LEVELS));
      const key = (hs[n] + 1) * LEVELS + level;
      let p = paths.get(key);
      if (p === undefined) paths.set(key, (p = new Path2D()));
      p.moveTo(0, qrow(is[n]) * row + row / 2);
      p.lineTo(width, js[n] * row + row / 2);
      drawn.heads.push(hs[n]);
      drawn.queries.push(is[n]);
      drawn.keys.push(js[n]);
      drawn.weights.push(as[n]);
      count++;
    }
    for (const [key, p] of paths) {
      const h = Math.floor(key / LEVELS) - 1;
      const alpha = Math.min(1, ((key % LEVELS) + 0.5) / LEVELS);
      ctx.strokeStyle = h < 0 ? `rgba(${AVERAGE.join(",")}, ${alpha})` : headColor(m.layer, h, alpha);
      ctx.stroke(p);
    }
    canvas.dataset.lines = String(count);
    canvas.dataset.candidates = String(all);
    canvas.attnkitLines = drawn;
    const heads = visibleHeads().length;
    const what = average
      ? `Each line: the mean of the ${heads} visible head${heads === 1 ? "'s" : "s'"} weights. `
      : "Each line: one head's weight, in its colour. ";
    $("line-note").textContent =
      what +
      (count < all
        ? `Showing the ${count.toLocaleString("en")} strongest of the ${all.toLocaleString("en")} lines in sight; ` +
          "hover a token to see its own."
        : "");
  }

  // Tokens on the other side of the hovered one: lit by their largest weight over the visible heads (their mean
  // weight, in the average mode), hatched where every visible head's mask hides them.
  function highlight() {
    const { m } = hv;
    const qs = $("hv-queries").children;
    const ks = $("hv-keys").children;
    for (const col of [qs, ks]) {
      for (const t of col) {
        t.classList.remove("active", "masked", "lit");
        t.style.background = "";
      }
    }
    const hover = S.hover;
    if (!hover) return;
    const heads = visibleHeads();
    const here = hover.side === "q" ? qs[hover.i] : ks[hover.i];
    if (here) here.classList.add("active");
    const other = hover.side === "q" ? ks : qs;
    const n = other.length;
    const best = new Float32Array(n);
    eachWeight(m, hover, (h, i, j, w) => {
      const x = hover.side === "q" ? j : i;
      if (w > best[x]) best[x] = w;
    });
    const hidden = new Uint8Array(n).fill(heads.length > 0 ? 1 : 0);
    for (const h of heads) {
      if (hover.side === "q") {
        for (let j = 0; j < n; j++) if (hidden[j] && !m.masked(h, hover.i, j)) hidden[j] = 0;
      } else {
        for (let i = 0; i < n; i++) if (hidden[i] && !m.masked(h, i, hover.i)) hidden[i] = 0;
      }
    }
    const norm = Math.max(1, m.call.scale);
    for (let x = 0; x < n; x++) {
      if (hidden[x]) {
        other[x].classList.add("masked");
      } else if (best[x] / norm >= LINE_MIN) {
        other[x].classList.add("lit");
        other[x].style.background = `rgba(43, 87, 151, ${(0.15 + 0.6 * Math.min(1, best[x] / norm)).toFixed(3)})`;
      }
    }
  }

  // ------------------------------------------------------------------------------------ model view
  const THUMB_MIN = 64; // px a side of a small matrix, at least (more when the window has room, up to THUMB_MAX)
  const THUMB_MAX = 200;
  const THUMB_ROW = 12; // px a row of a small matrix, at least: a decoding step's 1 x Lk is a strip, not a line
  const MASKED_GREY = [180, 180, 180];

  function image(tq, tk, colour) {
    const img = new ImageData(tk, tq);
    for (let x = 0; x < tq * tk; x++) {
      const [r, g, b] = colour(x);
      img.data[4 * x] = r;
      img.data[4 * x + 1] = g;
      img.data[4 * x + 2] = b;
      img.data[4 * x + 3] = 255;
    }
    return img;
  }

  // One call's small matrix for head h, from the page's thumbnails (bins of at most D.thumb cells a side).
  function thumbImage(call, h) {
    const bytes = blob(call.thumb);
    const n = call.tq * call.tk;
    return image(call.tq, call.tk, (x) => {
      const code = bytes[h * n + x];
      return code === 0 ? MASKED_GREY : shade((code - 1) / 254);
    });
  }

  // The first of the calls that call c continues: calls of as many queries as c, each call's following the call
  // before's (the same token lists; keys as many or more), as decoding steps through a cache do (a prefill of more
  // queries is not one of them). The model view stacks them, a row per query: the steps x keys matrix decoding
  // has made so far, rather than a strip of one query.
  function runStart(layer, c) {
    let c0 = c;
    while (c0 > 0) {
      const a = layer.calls[c0 - 1];
      const b = layer.calls[c0];
      if (a.lq !== b.lq || b.q !== a.q || b.k !== a.k || b.qoff !== a.qoff + a.lq || b.lk < a.lk) break;
      c0--;
    }
    return c0;
  }

  // Calls c0..c of layer l stacked, for head h: (rows, keys) bins of at most D.thumb a side, each the bins' mean
  // weight over the head's largest in those calls; grey where every cell of the bin is masked, or is a key its
  // call did not have yet.
  function stackedImage(l, c0, c, h) {
    const calls = D.layers[l].calls.slice(c0, c + 1);
    const R = calls.reduce((n, call) => n + call.lq, 0);
    const K = Math.max(...calls.map((call) => call.lk));
    const tq = Math.min(R, D.thumb);
    const tk = Math.min(K, D.thumb);
    const rowBin = new Int32Array(R);
    const keyBin = new Int32Array(K);
    for (let r = 0; r < R; r++) rowBin[r] = Math.min(tq - 1, Math.floor((r * tq) / R));
    for (let j = 0; j < K; j++) keyBin[j] = Math.min(tk - 1, Math.floor((j * tk) / K));
    const sum = new Float64Array(tq * tk);
    const cells = new Float64Array(tq * tk);
    const hidden = new Float64Array(tq * tk);
    const w = new Float32Array(K);
    let top = 0;
    let r = 0;
    calls.forEach((call, n) => {
      const m = matrix(l, c0 + n);
      for (let i = 0; i < m.lq; i++, r++) {
        w.fill(0);
        m.row(h, i, (j, x) => {
          w[j] = x;
          if (x > top) top = x;
        });
        const o = rowBin[r] * tk;
        for (let j = 0; j < K; j++) {
          const b = o + keyBin[j];
          cells[b] += 1;
          if (j >= m.lk || m.masked(h, i, j)) hidden[b] += 1;
          else sum[b] += w[j];
        }
      }
    });
    const img = image(tq, tk, (x) => (hidden[x] === cells[x] ? MASKED_GREY : shade(sum[x] / cells[x] / (top || 1))));
    return { img, tq, tk, rows: R, keys: K };
  }

  // px a side of a small matrix: the window's width shared by the heads, within THUMB_MIN..THUMB_MAX, and no
  // taller than lets every layer be seen at once where that leaves them 96 px or more.
  function thumbSide() {
    const grid = $("grid");
    const groups = Math.max(...D.layers.map((layer) => (layer.groups < layer.heads ? layer.groups : 1)));
    const width = grid.clientWidth || window.innerWidth - 28;
    // a row: its label (174 px), then per head a cell of side + 2 px (its border) and a gap of 4, a group's 10 more;
    // 16 px spare for a scrollbar the grid may bring
    const byWidth = Math.floor((width - 174 - 16 - 10 * (groups - 1)) / D.heads) - 6;
    const top = grid.getBoundingClientRect().top + window.scrollY;
    const byHeight = Math.floor((window.innerHeight - top - 40) / D.layers.length) - 4;
    return Math.max(THUMB_MIN, Math.min(THUMB_MAX, byWidth, Math.max(96, byHeight)));
  }

  function renderModelView() {
    const grid = $("grid");
    grid.textContent = "";
    const H = D.heads;
    const side = thumbSide();
    const header = document.createElement("div");
    header.className = "grid-row";
    header.appendChild(Object.assign(document.createElement("span"), { className: "row-label" }));
    for (let h = 0; h < H; h++) {
      const label = Object.assign(document.createElement("span"), { className: "col-label", textContent: `head ${h}` });
      label.style.width = side + 2 + "px";
      const g = D.layers[0].groups;
      const same = D.layers.every((layer) => layer.heads === H && layer.groups === g);
      if (same && g > 1 && g < H && h % (H / g) === 0 && h > 0) label.classList.add("group-start");
      header.appendChild(label);
    }
    grid.appendChild(header);
    D.layers.forEach((layer, l) => {
      const c = callOf(l);
      const c0 = runStart(layer, c);
      const call = layer.calls[c];
      const row = document.createElement("div");
      row.className = "grid-row";
      const label = document.createElement("span");
      label.className = "row-label";
      label.textContent = layer.name;
      const n = layer.calls.length;
      const what = c0 < c ? `calls ${c0 + 1} to ${c + 1} of ${n}, stacked` : `call ${c + 1} of ${n}`;
      label.title = `${layer.name}: ${what}, ${call.lq} x ${call.lk}`;
      row.appendChild(label);
      const per = layer.heads / layer.groups;
      for (let h = 0; h < layer.heads; h++) {
        const canvas = document.createElement("canvas");
        canvas.className = "thumb";
        const cell = document.createElement("span");
        cell.className = "cell";
        cell.style.width = cell.style.height = side + 2 + "px";
        if (layer.groups > 1 && layer.groups < layer.heads && h % per === 0 && h > 0) cell.classList.add("group-start");
        cell.appendChild(canvas);
        const t =
          c0 < c
            ? stackedImage(l, c0, c, h)
            : { img: thumbImage(call, h), tq: call.tq, tk: call.tk, rows: call.lq, keys: call.lk };
        canvas.width = t.tk;
        canvas.height = t.tq;
        // drawn `side` px along the longer side, in the matrix's proportions, but rows THUMB_ROW px tall at least
        const longest = Math.max(t.rows, t.keys);
        canvas.style.width = Math.max(3, Math.round((side * t.keys) / longest)) + "px";
        canvas.style.height = Math.min(side, Math.max(THUMB_ROW * t.tq, Math.round((side * t.rows) / longest))) + "px";
        canvas.dataset.layer = String(l);
        canvas.dataset.head = String(h);
        canvas.dataset.rows = String(t.rows);
        canvas.dataset.calls = `${c0} ${c}`;
        canvas.style.borderColor = headColor(layer, h, 1);
        canvas.getContext("2d").putImageData(t.img, 0, 0);
        const kv = layer.groups > 1 && layer.groups < layer.heads ? `, kv ${Math.floor(h / per)}` : "";
        const shape = c0 < c ? `${what}: ${t.rows} queries x ${t.keys} keys` : `${call.lq} x ${call.lk}`;
        canvas.title = `${layer.name}, head ${h}${kv}: ${shape}, largest ${fmt(call.hmax[h])} (this call)`;
        canvas.addEventListener("click", () => {
          S.layer = l;
          S.head = h;
          S.view = "matrix";
          render();
        });
        row.appendChild(cell);
      }
      grid.appendChild(row);
    });
  }

  // ----------------------------------------------------------------------------------- matrix view
  let mx = null;
  const LABEL_W = 150;
  const KEYS_H = 90;
  const CELL_MAX = 40; // px a side of a matrix view's cell, at most

  function renderMatrixView() {
    const l = S.layer;
    const c = callOf(l);
    const m = matrix(l, c);
    const h = S.head;
    headButtons(
      $("matrix-heads"),
      l,
      (x) => (x === h ? "chosen" : ""),
      (x) => {
        S.head = x;
        renderMatrixView();
      },
      null,
    );
    // px a cell: the matrix as wide as the window allows, and as tall as its height does (300 px at least)
    const wrapTop = $("matrix-wrap").getBoundingClientRect().top + window.scrollY;
    const roomW = ($("matrix-view").clientWidth || window.innerWidth - 28) - LABEL_W - 60;
    const roomH = Math.max(300, window.innerHeight - wrapTop - KEYS_H - 60);
    const cs = Math.max(1, Math.min(CELL_MAX, Math.floor(roomW / m.lk), Math.floor(roomH / m.lq)));
    const W = m.lk * cs;
    const Hpx = m.lq * cs;
    const canvas = $("mx-canvas");
    canvas.width = W;
    canvas.height = Hpx;
    canvas.style.left = LABEL_W + "px";
    canvas.style.top = KEYS_H + "px";
    const wrap = $("matrix-wrap");
    wrap.style.width = LABEL_W + W + 60 + "px";
    wrap.style.height = KEYS_H + Hpx + 10 + "px";
    const top = m.call.hmax[h] || 1;
    // one colour per cell (-1: masked), then the pixels
    const cell = new Float32Array(m.lq * m.lk).fill(m.kc ? -2 : 0); // -2: not kept
    for (let i = 0; i < m.lq; i++) {
      m.row(h, i, (j, w) => {
        cell[i * m.lk + j] = w;
      });
      for (let j = 0; j < m.lk; j++) if (m.masked(h, i, j)) cell[i * m.lk + j] = -1;
    }
    const img = new ImageData(W, Hpx);
    const px = img.data;
    for (let y = 0; y < Hpx; y++) {
      const i = Math.floor(y / cs);
      for (let x = 0; x < W; x++) {
        const v = cell[i * m.lk + Math.floor(x / cs)];
        const o = 4 * (y * W + x);
        if (v === -1) {
          const g = HATCH[Math.floor((x + y) / 3) % 2];
          px[o] = px[o + 1] = px[o + 2] = g;
        } else {
          const [r, gg, b] = shade(v < 0 ? 0 : v / top);
          px[o] = r;
          px[o + 1] = gg;
          px[o + 2] = b;
        }
        px[o + 3] = 255;
      }
    }
    canvas.getContext("2d").putImageData(img, 0, 0);
    // axis tokens: every position when there is room, else every n-th
    const every = Math.max(1, Math.ceil(13 / cs));
    const keys = $("mx-keys");
    const queries = $("mx-queries");
    keys.textContent = "";
    queries.textContent = "";
    keys.style.left = LABEL_W + "px";
    keys.style.top = "0px";
    keys.style.width = W + "px";
    keys.style.height = KEYS_H + "px";
    queries.style.left = "0px";
    queries.style.top = KEYS_H + "px";
    queries.style.width = LABEL_W - 6 + "px";
    for (let j = 0; j < m.lk; j += every) {
      const s = document.createElement("span");
      s.textContent = m.kLabel(j);
      if (m.padk[j]) s.className = "pad";
      s.style.left = j * cs + cs / 2 - 4 + "px";
      s.style.bottom = "2px";
      keys.appendChild(s);
    }
    for (let i = 0; i < m.lq; i += every) {
      const s = document.createElement("span");
      s.textContent = m.qLabel(i);
      if (m.padq[i]) s.className = "pad";
      s.style.right = "0px";
      s.style.top = i * cs + cs / 2 - 8 + "px";
      queries.appendChild(s);
    }
    const notKept = m.kc ? ` &nbsp; white: not kept (each row keeps its ${m.kc} largest)` : "";
    $("colorbar").innerHTML =
      `0 <span class="bar" style="background: linear-gradient(to right, #fff, rgb(${BLUE.join(",")}))"></span> ` +
      `${fmt(top)} (head ${h}'s largest) &nbsp; <span class="swatch masked" style="display:inline-block;width:14px;` +
      `height:12px;vertical-align:middle;background:var(--masked)"></span> masked${notKept}`;
    mx = { m, h, cs };
  }

  function describeCell(m, h, i, j) {
    const lines = [`query ${m.qPos(i)} ${JSON.stringify(m.qLabel(i))} -> key ${j} ${JSON.stringify(m.kLabel(j))}`];
    if (m.masked(h, i, j)) {
      lines.push(m.padk[j] ? "masked: padding, no query sees this key" : "masked: hidden from this query");
    } else {
      const w = m.value(h, i, j);
      if (w < 0) lines.push(`not kept: below ${fmt(m.threshold(h, i))}, the least of the row's ${m.kc} kept`);
      else lines.push(`weight ${m.f ? fmt(w) : "~" + fmt(w) + " (+-" + fmt(m.unit / 2) + ")"}`);
    }
    return lines.join("\n");
  }

  function onMatrixMove(e) {
    if (!mx) return;
    const r = e.target.getBoundingClientRect();
    const i = Math.floor((e.clientY - r.top) / mx.cs);
    const j = Math.floor((e.clientX - r.left) / mx.cs);
    if (i < 0 || j < 0 || i >= mx.m.lq || j >= mx.m.lk) return hideTip();
    showTip(e, describeCell(mx.m, mx.h, i, j));
  }

  // ------------------------------------------------------------------------------------------- tip
  function showTip(e, text) {
    const tip = $("tip");
    tip.textContent = text;
    tip.hidden = false;
    tip.style.left = Math.min(e.clientX + 14, window.innerWidth - tip.offsetWidth - 4) + "px";
    tip.style.top = e.clientY + 16 + "px";
  }
  function hideTip() {
    $("tip").hidden = true;
  }

  // ---------------------------------------------------------------------------------------- render
  function render() {
    renderHeader();
    hideTip();
    if (S.view === "head") renderHeadView();
    else if (S.view === "model") renderModelView();
    else renderMatrixView();
  }

  setupHeader();
  readHash();
  const body = $("hv-body");
  body.addEventListener("mouseover", onTokenHover);
  body.addEventListener("mouseleave", onTokenLeave);
  let pending = false;
  let relayoutPending = false;
  const relayout = () => {
    // the window's size sets the head view's width and rows, the small matrices' and the matrix's cells
    if (relayoutPending) return;
    relayoutPending = true;
    requestAnimationFrame(() => {
      relayoutPending = false;
      if (S.view === "head") renderHeadView();
      else if (S.view === "model") renderModelView();
      else renderMatrixView();
    });
  };
  const redraw = () => {
    if (pending || !hv || S.view !== "head") return;
    pending = true;
    requestAnimationFrame(() => {
      pending = false;
      fitCanvas();
      drawLines();
    });
  };
  body.addEventListener("scroll", redraw, { passive: true });
  window.addEventListener("resize", relayout);
  $("hv-lines").addEventListener("mouseenter", onTokenLeave);
  $("mx-canvas").addEventListener("mousemove", onMatrixMove);
  $("mx-canvas").addEventListener("mouseleave", hideTip);
  render();
  document.documentElement.dataset.ready = String(Math.round(performance.now()));
})();
