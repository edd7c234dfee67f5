/* storylens attention widget. Inlined into the page by storylens.viz.widget; no network.
 *
 * Every piece of story text goes into the DOM with textContent, never as markup.
 * Two views:
 *   attention: click a token (the query) and see the attention it gives every earlier
 *              token, for one block and head or for all heads at once;
 *   toy:       hand-set two-number queries and keys; score = q.k, softmax, shares.
 */
(function () {
  "use strict";
  var VERSION = "2";
  if (window.StorylensWidget && window.StorylensWidget.version === VERSION) { return; }

  // ------------------------------------------------------------------ helpers
  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) { e.className = cls; }
    if (text !== undefined && text !== null) { e.textContent = String(text); }
    return e;
  }

  function headLabel(b, h) { return "L" + (b + 1) + "H" + (h + 1); }

  // A token's text, made visible: newlines and tabs as symbols, a lone space as a dot.
  function shown(text) {
    var t = String(text).replace(/\r/g, "").replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5");
    return t.length ? t : "\u2205";
  }

  // One-line compact form for lists: trimmed, a pure-space token as a visible space sign.
  function compact(text) {
    var t = shown(text).trim();
    return t.length ? t : "\u2423";
  }

  function pct(w) { return (100 * w).toFixed(w >= 0.1 ? 1 : 2) + "%"; }

  // Shade: blue with opacity proportional to the weight relative to the row's largest.
  function shade(w, max) {
    var a = max > 0 ? Math.min(1, w / max) : 0;
    return { bg: "rgba(31, 119, 180, " + (0.92 * a).toFixed(3) + ")", dark: a > 0.55 };
  }

  // The replay buttons' marks as inline SVG (no font glyph): triangles and bars in currentColor.
  var ICONS = {
    first: "M3 2h2v12H3zM13 2v12L6 8z",
    prev: "M12 2v12L4 8z",
    next: "M4 2v12l8-6z",
    play: "M4 2v12l8-6z",
    pause: "M4 2h3v12H4zM9 2h3v12H9z",
    last: "M3 2v12l7-6zM11 2h2v12h-2z"
  };
  function icon(kind) {
    var ns = "http://www.w3.org/2000/svg";
    var svg = document.createElementNS(ns, "svg");
    svg.setAttribute("viewBox", "0 0 16 16");
    svg.setAttribute("width", "12");
    svg.setAttribute("height", "12");
    svg.setAttribute("aria-hidden", "true");
    svg.setAttribute("class", "slw-icon slw-icon-" + kind);
    var path = document.createElementNS(ns, "path");
    path.setAttribute("d", ICONS[kind]);
    path.setAttribute("fill", "currentColor");
    svg.appendChild(path);
    return svg;
  }
  // A replay button: its mark, then its word (marks pointing forward go after the word).
  function rpButton(cls, kind, word, tip) {
    var b = el("button", cls);
    b.type = "button";
    b.title = tip;
    var label = el("span", "slw-rp-word", word);
    if (kind === "next" || kind === "last") { b.appendChild(label); b.appendChild(icon(kind)); }
    else { b.appendChild(icon(kind)); b.appendChild(label); }
    return b;
  }

  function option(select, value, text) {
    var o = el("option", null, text);
    o.value = String(value);
    select.appendChild(o);
  }

  // ------------------------------------------------------------------ attention view
  /* The attention view's one object, handed to every function below: what the data fixes (the
   * tokens, the sizes, the quantised weights), what the reader chose (state), and the elements
   * the view draws into (ui, filled as they are built). */
  function attentionView(root, data) {
    var T = data.tokens.length, nB = data.nBlock, nH = data.nHead;
    return {
      root: root, data: data, tokens: data.tokens, T: T, nB: nB, nH: nH,
      tri: T * (T + 1) / 2,  // one head's lower triangle, quantised, in data.att.values
      dec: data.att.bits === 16 ? 5 : 3,  // shown decimals: the quantisation step's
      allAtOnce: nB * nH <= data.allAtOnce,
      mapN: Math.min(T, 32),  // the maps' window of tokens
      replay: data.replay || null,  // a generated story, written token by token (start: first new token)
      state: { block: data.block, head: data.head, query: data.query, mode: data.mode || "one", from: 0, written: T - 1 },
      timer: null,  // the replay's Play
      ui: {},
      spans: []  // the story's token spans, one per position
    };
  }

  // weights of query q over keys 0..q, exactly as embedded (level / levels)
  function row(v, b, h, q) {
    var att = v.data.att, off = (b * v.nH + h) * v.tri + q * (q + 1) / 2;
    var out = new Array(q + 1);
    for (var i = 0; i <= q; i++) { out[i] = att.values[off + i] / att.levels; }
    return out;
  }
  function exact(w) { return String(w); }  // data-weight: the shown weight, every digit

  function describe(v, pos, w) {
    var d = "\u201c" + compact(v.tokens[pos]) + "\u201d at position " + pos;
    if (w === null) { return d + ": after the query, masked (share 0)"; }
    return d + ": weight " + w.toFixed(v.dec) + " (" + pct(w) + ")";
  }

  function modeButton(mode, text, title) {
    var b = el("button", "slw-mode slw-mode-" + mode, text);
    if (title) { b.title = title; }
    b.type = "button";
    return b;
  }

  // The title, the block and head selects, the head's badge, the three modes, export, the info line.
  function buildControls(v) {
    var ui = v.ui;
    v.root.textContent = "";
    v.root.classList.add("slw-attention");
    var header = el("div", "slw-header");
    header.appendChild(el("div", "slw-title", v.data.title));
    v.root.appendChild(header);
    var controls = el("div", "slw-controls");
    var lb = el("label", "slw-ctl", "Block ");
    ui.selB = el("select", "slw-block");
    for (var b = 0; b < v.nB; b++) { option(ui.selB, b, "L" + (b + 1)); }
    lb.appendChild(ui.selB);
    var lh = el("label", "slw-ctl", "Head ");
    ui.selH = el("select", "slw-head");
    for (var h = 0; h < v.nH; h++) { option(ui.selH, h, "H" + (h + 1)); }
    lh.appendChild(ui.selH);
    ui.badge = el("span", "slw-badge");
    ui.modes = {
      one: modeButton("one", "One head"),
      all: modeButton("all", v.allAtOnce ? "All " + (v.nB * v.nH) + " heads" : "All heads of the block"),
      maps: modeButton("maps", "Maps", "every head of the block as a map of a window of tokens")
    };
    [lb, lh, ui.badge, ui.modes.one, ui.modes.all, ui.modes.maps].forEach(function (e) { controls.appendChild(e); });
    controls.appendChild(window.StorylensExport.buttons(function () { return viewSvg(v); }, function () { return viewName(v); }));
    v.root.appendChild(controls);
    ui.info = el("div", "slw-info");
    v.root.appendChild(ui.info);
  }

  // ---- replay: a generated story, written token by token (data.replay.start = first new token).
  // The page opens on the whole story; the buttons' marks are drawn (inline SVG) beside plain
  // ASCII words, so no font can turn them into empty boxes.
  function buildReplay(v) {
    var rp = el("div", "slw-replay");
    var bFirst = rpButton("slw-rp-first", "first", "Prompt", "Back to the prompt alone");
    var bPrev = rpButton("slw-rp-prev", "prev", "Back", "Unwrite the last token");
    var bNext = rpButton("slw-rp-next", "next", "Step", "Write the next token");
    var bPlay = rpButton("slw-rp-play", "play", "Play", "Write the rest token by token");
    var bLast = rpButton("slw-rp-last", "last", "Whole story", "Show the whole story");
    v.ui.rpPlay = bPlay;
    v.ui.rpInfo = el("span", "slw-rp-info");
    [bFirst, bPrev, bNext, bPlay, bLast].forEach(function (b) { rp.appendChild(b); });
    rp.appendChild(v.ui.rpInfo);
    v.root.insertBefore(rp, v.ui.info);
    bFirst.addEventListener("click", function () { stopReplay(v); setWritten(v, 0); });
    bPrev.addEventListener("click", function () { stopReplay(v); setWritten(v, v.state.written - 1); });
    bNext.addEventListener("click", function () { stopReplay(v); setWritten(v, v.state.written + 1); });
    bLast.addEventListener("click", function () { stopReplay(v); setWritten(v, v.T - 1); });
    bPlay.addEventListener("click", function () { togglePlay(v); });
  }
  function setPlaying(v, on) {
    var b = v.ui.rpPlay;
    b.replaceChild(icon(on ? "pause" : "play"), b.firstChild);
    b.lastChild.textContent = on ? "Pause" : "Play";
  }
  function setWritten(v, n) {
    v.state.written = Math.max(v.replay.start - 1, Math.min(v.T - 1, n));
    v.state.query = v.state.written;
    renderAttention(v);
    reveal(v);
  }
  function stopReplay(v) {
    if (v.timer !== null) { clearInterval(v.timer); v.timer = null; }
    setPlaying(v, false);
  }
  function togglePlay(v) {
    if (v.timer !== null) { stopReplay(v); return; }
    if (v.state.written >= v.T - 1) { setWritten(v, 0); }
    setPlaying(v, true);
    v.timer = setInterval(function () {
      if (v.state.written >= v.T - 1) { stopReplay(v); return; }
      setWritten(v, v.state.written + 1);
    }, 350);
  }

  // The story's tokens (click one: the query) beside the query's top keys, the hover line, the
  // all-heads grid and the note on shading and precision.
  function buildBody(v) {
    var ui = v.ui;
    var body = el("div", "slw-body");
    ui.textBox = el("div", "slw-tokens");
    ui.textBox.tabIndex = 0;
    ui.textBox.setAttribute("role", "listbox");
    ui.textBox.setAttribute("aria-label", "story tokens: click one to make it the query");
    ui.side = el("div", "slw-side");
    body.appendChild(ui.textBox); body.appendChild(ui.side);
    v.root.appendChild(body);
    ui.hover = el("div", "slw-hover", "Hover a token to read its weight.");
    v.root.appendChild(ui.hover);
    ui.grid = el("div", "slw-grid");
    v.root.appendChild(ui.grid);
    v.root.appendChild(el("div", "slw-note",
      "Shading is relative to the largest weight in the row; tokens after the query are " +
      "masked (their share is exactly 0). Weights are embedded at " + v.data.att.bits + " bits: each is within " +
      v.data.maxError.toExponential(1) + " of the recorded one."));
    for (var i = 0; i < v.T; i++) { v.spans.push(tokenSpan(v, i)); }
  }
  function tokenSpan(v, i) {
    var t = v.tokens[i];
    var s = el("span", "slw-tok", shown(t));
    s.setAttribute("data-pos", String(i));
    s.setAttribute("role", "option");
    if (i === 0 && /^<.*>$/.test(t)) { s.classList.add("slw-special"); }
    v.ui.textBox.appendChild(s);
    var nl = (String(t).match(/\n/g) || []).length;
    for (var k = 0; k < nl; k++) { v.ui.textBox.appendChild(document.createElement("br")); }
    return s;
  }

  // Shade every token by the weight the query gives it; returns the query's row.
  function renderTokens(v) {
    var q = v.state.query;
    var w = row(v, v.state.block, v.state.head, q);
    var max = 0;
    for (var i = 0; i <= q; i++) { if (w[i] > max) { max = w[i]; } }
    for (i = 0; i < v.T; i++) {
      var s = v.spans[i];
      s.classList.toggle("slw-unwritten", i > v.state.written);  // replay: not written yet
      s.classList.toggle("slw-query", i === q);
      s.setAttribute("aria-selected", i === q ? "true" : "false");
      if (i <= q) {
        var c = shade(w[i], max);
        s.style.backgroundColor = c.bg;
        s.classList.toggle("slw-dark", c.dark);
        s.classList.remove("slw-future");
        s.setAttribute("data-weight", exact(w[i]));
        s.title = describe(v, i, w[i]);
      } else {
        s.style.backgroundColor = "";
        s.classList.remove("slw-dark");
        s.classList.add("slw-future");
        s.removeAttribute("data-weight");
        s.title = describe(v, i, null);
      }
    }
    return w;
  }

  // The side list: the query's top 10 keys with bars, and the row's sum.
  function renderSide(v, w) {
    var side = v.ui.side, q = v.state.query;
    side.textContent = "";
    side.appendChild(el("div", "slw-side-title",
      "Top " + Math.min(10, q + 1) + " of " + (q + 1) + " for " + headLabel(v.state.block, v.state.head)));
    var order = [];
    for (var i = 0; i <= q; i++) { order.push(i); }
    order.sort(function (a, b) { return w[b] - w[a] || a - b; });
    var list = el("ol", "slw-top");
    var max = w[order[0]] || 1;
    for (var r = 0; r < Math.min(10, order.length); r++) {
      var pos = order[r];
      var li = el("li", "slw-top-item");
      li.setAttribute("data-pos", String(pos));
      li.setAttribute("data-weight", exact(w[pos]));
      li.appendChild(el("span", "slw-top-tok", compact(v.tokens[pos])));
      li.appendChild(el("span", "slw-top-pos", "#" + pos));
      var bar = el("span", "slw-bar");
      var fill = el("span", "slw-bar-fill");
      fill.style.width = (100 * w[pos] / max).toFixed(1) + "%";
      bar.appendChild(fill);
      li.appendChild(bar);
      li.appendChild(el("span", "slw-top-w", w[pos].toFixed(v.dec)));
      li.title = describe(v, pos, w[pos]);
      list.appendChild(li);
    }
    side.appendChild(list);
    var total = 0;
    for (i = 0; i <= q; i++) { total += w[i]; }
    side.appendChild(el("div", "slw-sum", "Row sum: " + total.toFixed(4)));
  }

  // ---- all heads: the query's row in every head (of the block, where there are too many), a panel each
  function renderGrid(v) {
    var grid = v.ui.grid;
    grid.textContent = "";
    if (v.state.mode !== "all") { grid.hidden = true; return; }
    grid.hidden = false;
    grid.style.gridTemplateColumns = "repeat(" + v.nH + ", minmax(0, 1fr))";
    for (var b = 0; b < v.nB; b++) {
      if (!v.allAtOnce && b !== v.state.block) { continue; }
      for (var h = 0; h < v.nH; h++) { grid.appendChild(headPanel(v, b, h, v.state.query)); }
    }
  }
  function headPanel(v, b, h, q) {
    var w = row(v, b, h, q);
    var max = 0, best = [];
    for (var i = 0; i <= q; i++) { if (w[i] > max) { max = w[i]; } best.push(i); }
    best.sort(function (x, y) { return w[y] - w[x] || x - y; });
    var panel = el("div", "slw-panel");
    panel.setAttribute("data-block", String(b));
    panel.setAttribute("data-head", String(h));
    panel.setAttribute("data-label", headLabel(b, h));
    if (b === v.state.block && h === v.state.head) { panel.classList.add("slw-panel-sel"); }
    panel.title = headLabel(b, h) + ": click to show this head on the story";
    panel.appendChild(el("div", "slw-panel-label", headLabel(b, h)));
    var strip = el("div", "slw-strip");
    for (i = 0; i <= q; i++) {
      var cell = el("span", "slw-cell");
      cell.style.backgroundColor = shade(w[i], max).bg;
      cell.setAttribute("data-pos", String(i));
      cell.setAttribute("data-weight", exact(w[i]));
      cell.title = headLabel(b, h) + ": " + describe(v, i, w[i]);
      strip.appendChild(cell);
    }
    panel.appendChild(strip);
    var tops = el("div", "slw-panel-top");
    for (var r = 0; r < Math.min(3, best.length); r++) {
      var p = best[r];
      var item = el("span", "slw-panel-item", compact(v.tokens[p]) + " " + w[p].toFixed(3));
      item.setAttribute("data-pos", String(p));
      tops.appendChild(item);
    }
    panel.appendChild(tops);
    return panel;
  }

  // ---- maps: every head of one block over a window of tokens, each token labelled
  var MAP_CELL = 14, MAP_LABEL_PX = 11, MASKED = "#262626";
  // viridis (matplotlib's), 9 stops, on the report's power scale (gamma 0.5), 0 to 1
  var VIRIDIS = [[68, 1, 84], [71, 44, 122], [59, 81, 139], [44, 113, 142], [33, 144, 141],
    [39, 173, 129], [92, 200, 99], [170, 220, 50], [253, 231, 37]];
  function viridis(w) {
    var x = Math.sqrt(Math.max(0, Math.min(1, w))) * 8, i = Math.min(7, Math.floor(x)), f = x - i;
    var a = VIRIDIS[i], b = VIRIDIS[i + 1];
    return "rgb(" + [0, 1, 2].map(function (k) { return Math.round(a[k] + f * (b[k] - a[k])); }).join(",") + ")";
  }

  function buildMaps(v) {
    var ui = v.ui;
    ui.maps = el("div", "slw-maps");
    var nav = el("div", "slw-map-nav");
    var prev = el("button", "slw-mode slw-map-prev", "\u2190 earlier");
    var next = el("button", "slw-mode slw-map-next", "later \u2192");
    ui.mapFrom = el("input", "slw-map-from");
    ui.mapFrom.type = "number"; ui.mapFrom.min = "0"; ui.mapFrom.max = String(v.T - v.mapN); ui.mapFrom.value = "0";
    var lab = el("label", "slw-ctl", "tokens from ");
    lab.appendChild(ui.mapFrom);
    prev.type = "button"; next.type = "button";
    nav.appendChild(prev); nav.appendChild(lab); nav.appendChild(next);
    ui.mapInfo = el("span", "slw-map-info");
    nav.appendChild(ui.mapInfo);
    ui.mapGrid = el("div", "slw-map-grid");
    ui.maps.appendChild(nav); ui.maps.appendChild(ui.mapGrid);
    v.root.insertBefore(ui.maps, ui.grid);
    prev.addEventListener("click", function () { setFrom(v, v.state.from - v.mapN); });
    next.addEventListener("click", function () { setFrom(v, v.state.from + v.mapN); });
    ui.mapFrom.addEventListener("change", function () { setFrom(v, parseInt(ui.mapFrom.value, 10)); });
    ui.mapGrid.addEventListener("click", function (ev) {
      var fig = ev.target && ev.target.closest ? ev.target.closest(".slw-map") : null;
      if (!fig) { return; }
      v.state.head = parseInt(fig.getAttribute("data-head"), 10);
      renderAttention(v);
    });
  }
  function setFrom(v, from) {
    v.state.from = Math.max(0, Math.min(v.T - v.mapN, isNaN(from) ? 0 : from));
    renderAttention(v);
  }
  function mapLabels(v) {
    var out = [];
    for (var i = v.state.from; i < v.state.from + v.mapN; i++) { out.push(compact(v.tokens[i])); }
    return out;
  }
  function mapFill(v, b, h) {
    var cache = {};
    return function (r, c) {
      var q = v.state.from + r, k = v.state.from + c;
      if (k > q) { return MASKED; }
      if (!cache[q]) { cache[q] = row(v, b, h, q); }
      return viridis(cache[q][k]);
    };
  }
  function mapSpec(v, b, h) {
    return { rows: v.mapN, cols: v.mapN, fill: mapFill(v, b, h), rowLabels: mapLabels(v), colLabels: mapLabels(v),
      title: headLabel(b, h), cell: [MAP_CELL, MAP_CELL], size: MAP_LABEL_PX };
  }
  function renderMaps(v) {
    var ui = v.ui, s = v.state, last = s.from + v.mapN - 1;
    ui.maps.hidden = s.mode !== "maps";
    if (ui.maps.hidden) { return; }
    ui.mapFrom.value = String(s.from);
    ui.mapInfo.textContent = " block L" + (s.block + 1) + ", tokens " + s.from + " to " + last + " of " + v.T +
      "; rows: queries, columns: keys; viridis on a power scale, 0 to 1; dark grey: masked. Click a map to select its head.";
    ui.mapGrid.textContent = "";
    for (var h = 0; h < v.nH; h++) {
      var fig = el("div", "slw-map");
      fig.setAttribute("data-block", String(s.block));
      fig.setAttribute("data-head", String(h));
      fig.setAttribute("data-label", headLabel(s.block, h));
      if (h === s.head) { fig.classList.add("slw-panel-sel"); }
      var img = new Image();
      img.alt = headLabel(s.block, h) + ": attention map, tokens " + s.from + " to " + last;
      img.src = "data:image/svg+xml;charset=utf-8," + encodeURIComponent(window.StorylensExport.gridSvg(mapSpec(v, s.block, h)));
      fig.appendChild(img);
      ui.mapGrid.appendChild(fig);
    }
  }

  // ---- what the PNG and SVG buttons save: the view on screen
  function viewName(v) {
    var s = v.state;
    if (s.mode === "maps") { return "attention-maps-L" + (s.block + 1) + "-from" + s.from; }
    return "attention-" + headLabel(s.block, s.head) + "-query" + s.query + (s.mode === "all" ? "-heads" : "");
  }
  function viewSvg(v) {
    if (v.state.mode === "maps") {
      var svgs = [];
      for (var h = 0; h < v.nH; h++) { svgs.push(window.StorylensExport.gridSvg(mapSpec(v, v.state.block, h))); }
      return stack(svgs, 2);
    }
    return v.state.mode === "all" ? allHeadsSvg(v) : oneHeadSvg(v);
  }
  // the query's row in every head shown, a row each
  function allHeadsSvg(v) {
    var q = v.state.query, heads = [];
    for (var b = 0; b < v.nB; b++) {
      if (!v.allAtOnce && b !== v.state.block) { continue; }
      for (var h = 0; h < v.nH; h++) { heads.push([b, h, row(v, b, h, q)]); }
    }
    return window.StorylensExport.gridSvg({ rows: heads.length, cols: q + 1, cell: [Math.max(3, Math.min(14, 900 / (q + 1))), 14],
      rowLabels: heads.map(function (x) { return headLabel(x[0], x[1]); }), colLabels: [], size: 11,
      title: "Query \u201c" + compact(v.tokens[q]) + "\u201d (position " + q + "): its row in every head",
      fill: function (r, c) { var w = heads[r][2], m = Math.max.apply(null, w); return shade(w[c], m).bg; } });
  }
  // the story shaded by the chosen head's row for the query
  function oneHeadSvg(v) {
    var s = v.state, w = row(v, s.block, s.head, s.query), max = Math.max.apply(null, w);
    var items = [];
    for (var i = 0; i < v.T; i++) {
      items.push({ text: shown(v.tokens[i]), fill: i <= s.query ? shade(w[i], max).bg : "#f0f0f0", bold: i === s.query });
    }
    return window.StorylensExport.tokensSvg(items,
      { title: v.data.title + ": " + headLabel(s.block, s.head) + ", query " + s.query, width: 900 });
  }
  // several SVG documents side by side, `per` to a row (sizes read from their own headers)
  function stack(svgs, per) {
    var x = 0, y = 0, rowH = 0, width = 0, body = "";
    svgs.forEach(function (s, i) {
      var m = /width="(\d+)" height="(\d+)"/.exec(s), w = +m[1], hgt = +m[2];
      if (i % per === 0 && i > 0) { y += rowH + 10; x = 0; rowH = 0; }
      body += '<svg x="' + x + '" y="' + y + '"' + s.slice(4);
      x += w + 10; rowH = Math.max(rowH, hgt); width = Math.max(width, x);
    });
    return window.StorylensExport.doc(width, y + rowH, body);
  }

  // ---- drawing the state: controls, the replay's line, the info line, then every view
  function renderAttention(v) {
    var s = v.state, ui = v.ui;
    ui.selB.value = String(s.block);
    ui.selH.value = String(s.head);
    ui.badge.textContent = headLabel(s.block, s.head);
    ["one", "all", "maps"].forEach(function (m) { ui.modes[m].setAttribute("aria-pressed", s.mode === m ? "true" : "false"); });
    v.root.setAttribute("data-block", String(s.block));
    v.root.setAttribute("data-head", String(s.head));
    v.root.setAttribute("data-query", String(s.query));
    v.root.setAttribute("data-mode", s.mode);
    v.root.setAttribute("data-written", String(s.written));
    if (v.replay) { ui.rpInfo.textContent = replayText(v); }
    ui.info.textContent = "";
    ui.info.appendChild(document.createTextNode("Query: "));
    ui.info.appendChild(el("span", "slw-info-tok", compact(v.tokens[s.query])));
    ui.info.appendChild(document.createTextNode(
      " (position " + s.query + "), looking at the " + (s.query + 1) +
      " tokens up to itself with " + headLabel(s.block, s.head) + ". Click any token to make it the query."));
    renderSide(v, renderTokens(v));
    renderGrid(v);
    renderMaps(v);
  }
  function replayText(v) {
    var start = v.replay.start, k = v.state.written - start + 1, nNew = v.T - start;
    if (k >= nNew) {
      return "The whole story: " + nNew + " new tokens after a " + start + "-token prompt. " +
        "Go back to the Prompt, then Step or Play to watch the model write it.";
    }
    if (k > 0) {
      return "Written " + k + " of " + nNew + " new tokens. Each one is shown with the " +
        "attention it gave while the model read it (recorded during KV-cached generation).";
    }
    return "The prompt (" + start + " tokens). Step or Play to watch the model write.";
  }

  // Scroll the token box (only the box, never the page) so the query is in view.
  function reveal(v) {
    var s = v.spans[v.state.query], box = v.ui.textBox;
    var top = s.offsetTop, bottom = top + s.offsetHeight;
    if (top < box.scrollTop || bottom > box.scrollTop + box.clientHeight) {
      box.scrollTop = Math.max(0, top - box.clientHeight / 2);
    }
  }

  // The hover line: the weight under the pointer (a grid cell says its head too).
  function onHover(v, ev) {
    var t = ev.target;
    if (!t || !t.getAttribute) { return; }
    var p = t.getAttribute("data-pos");
    if (p === null) { return; }
    var wt = t.getAttribute("data-weight");
    var label = t.classList.contains("slw-cell") ? t.title : null;
    v.ui.hover.textContent = label || describe(v, parseInt(p, 10), wt === null ? null : parseFloat(wt));
  }

  // The reader's choices: a token (click, arrow keys), a panel, a block, a head, a mode.
  function wireAttention(v) {
    var ui = v.ui, s = v.state;
    function redraw() { renderAttention(v); }
    ui.textBox.addEventListener("click", function (ev) {
      var t = ev.target;
      if (!t || !t.getAttribute) { return; }
      var p = t.getAttribute("data-pos");
      if (p === null || parseInt(p, 10) > s.written) { return; }
      s.query = parseInt(p, 10);
      redraw();
    });
    ui.textBox.addEventListener("keydown", function (ev) {
      if (ev.key === "ArrowRight" && s.query < s.written) { s.query++; }
      else if (ev.key === "ArrowLeft" && s.query > 0) { s.query--; }
      else { return; }
      ev.preventDefault();
      redraw();
      reveal(v);
    });
    ui.textBox.addEventListener("mouseover", function (ev) { onHover(v, ev); });
    ui.grid.addEventListener("mouseover", function (ev) { onHover(v, ev); });
    ui.side.addEventListener("mouseover", function (ev) {
      var li = ev.target && ev.target.closest ? ev.target.closest(".slw-top-item") : null;
      if (li) { ui.hover.textContent = li.title; }
    });
    ui.grid.addEventListener("click", function (ev) {
      var panel = ev.target && ev.target.closest ? ev.target.closest(".slw-panel") : null;
      if (!panel) { return; }
      s.block = parseInt(panel.getAttribute("data-block"), 10);
      s.head = parseInt(panel.getAttribute("data-head"), 10);
      redraw();
    });
    ui.selB.addEventListener("change", function () { s.block = parseInt(ui.selB.value, 10); redraw(); });
    ui.selH.addEventListener("change", function () { s.head = parseInt(ui.selH.value, 10); redraw(); });
    ["one", "all", "maps"].forEach(function (m) {
      ui.modes[m].addEventListener("click", function () { s.mode = m; redraw(); });
    });
  }

  function mountAttention(root, data) {
    var v = attentionView(root, data);
    buildControls(v);
    if (v.replay) { buildReplay(v); }
    buildBody(v);
    buildMaps(v);
    wireAttention(v);
    renderAttention(v);
    reveal(v);
  }

  // ------------------------------------------------------------------ toy view
  function copy(x) { return JSON.parse(JSON.stringify(x)); }

  /* The toy view's one object, handed to every function below: the words and their hand-set
   * vectors (original, to reset to), what the reader set and chose (state), the elements (ui)
   * and the table's live cells (rows: per word {tr, score, exp, share, fill}). */
  function toyView(root, data) {
    return {
      root: root, data: data, words: data.words, n: data.words.length,
      dim: data.q.length ? data.q[0].length : 2,
      original: { q: copy(data.q), k: copy(data.k) },
      state: { q: copy(data.q), k: copy(data.k), query: data.query },
      ui: {},
      rows: []
    };
  }

  // The title with export, the explanation, the word chips, the query line, the table, its foot, reset.
  function buildToy(t) {
    var ui = t.ui;
    t.root.textContent = "";
    t.root.classList.add("slw-toy");
    var header = el("div", "slw-header");
    header.appendChild(el("div", "slw-title", t.data.title));
    header.appendChild(window.StorylensExport.buttons(function () { return toySvg(t); },
      function () { return "toy-attention-" + t.words[t.state.query]; }));
    t.root.appendChild(header);
    t.root.appendChild(el("div", "slw-info",
      "Click a word to make it the query. Each word has a query (the question it asks) and a " +
      "key (the card it holds up), " + t.dim + " numbers each, set by hand. Score = q\u00b7k " +
      "(multiply and add); the softmax turns the scores into shares that add to 100%. " +
      "Words after the query are masked."));
    ui.chips = el("div", "slw-chips");
    t.root.appendChild(ui.chips);
    ui.chipEls = [];
    for (var i = 0; i < t.n; i++) {
      var c = el("button", "slw-chip", t.words[i]);
      c.type = "button";
      c.setAttribute("data-index", String(i));
      ui.chips.appendChild(c);
      ui.chipEls.push(c);
    }
    ui.qline = el("div", "slw-qline");
    ui.table = el("table", "slw-toy-table");
    ui.foot = el("div", "slw-note");
    ui.reset = el("button", "slw-mode slw-reset", "Reset to the hand-set numbers");
    ui.reset.type = "button";
    [ui.qline, ui.table, ui.foot, ui.reset].forEach(function (e) { t.root.appendChild(e); });
  }

  // the shares as the page shows them: the query's row over the words it can see
  function toySvg(t) {
    var r = toyShares(t), max = Math.max.apply(null, r.shares), qi = t.state.query;
    var items = t.words.map(function (w, j) {
      return { text: j <= qi ? w + " " + pct(r.shares[j]) : w, fill: j <= qi ? shade(r.shares[j], max).bg : "#f0f0f0", bold: j === qi };
    });
    return window.StorylensExport.tokensSvg(items, { title: t.data.title + ": the shares of \u201c" + t.words[qi] + "\u201d", width: 900 });
  }

  function num(v) { return String(Math.round(v * 1000) / 1000); }
  function fmtBig(v) { return v < 1e6 ? v.toFixed(2) : v.toExponential(2); }

  // A number input bound to vec[j]: typing a finite number sets it and calls onchange.
  function vecInput(vec, j, cls, onchange) {
    var inp = el("input", "slw-num " + cls);
    inp.type = "number";
    inp.step = "0.1";
    inp.value = String(vec[j]);
    inp.setAttribute("aria-label", cls + " " + (j + 1));
    inp.addEventListener("input", function () {
      var v = parseFloat(inp.value);
      if (isFinite(v)) { vec[j] = v; onchange(); }
    });
    return inp;
  }

  // The query's scores over the words it sees, their softmax shares and e^score itself.
  function toyShares(t) {
    var qi = t.state.query, qv = t.state.q[qi];
    var scores = [], maxS = -Infinity;
    for (var j = 0; j <= qi; j++) {
      var s = 0;
      for (var d = 0; d < t.dim; d++) { s += qv[d] * t.state.k[j][d]; }
      scores.push(s);
      if (s > maxS) { maxS = s; }
    }
    var exps = [], total = 0;
    for (j = 0; j <= qi; j++) { var e = Math.exp(scores[j] - maxS); exps.push(e); total += e; }
    var shares = exps.map(function (e) { return e / total; });
    // e^score itself for display (may overflow for huge scores; shares stay exact)
    var rawExp = scores.map(function (s) { return Math.exp(s); });
    return { scores: scores, shares: shares, rawExp: rawExp };
  }

  function renderQuery(t) {
    var qline = t.ui.qline, qi = t.state.query;
    qline.textContent = "";
    qline.appendChild(document.createTextNode("Query word "));
    qline.appendChild(el("b", "slw-info-tok", t.words[qi]));
    qline.appendChild(document.createTextNode(" asks q = ("));
    for (var d = 0; d < t.dim; d++) {
      if (d) { qline.appendChild(document.createTextNode(", ")); }
      qline.appendChild(vecInput(t.state.q[qi], d, "slw-q", function () { updateToy(t); }));
    }
    qline.appendChild(document.createTextNode(")"));
  }

  // Rebuild the table (when the query changes): inputs are created once per build,
  // so typing in one keeps its focus while updateToy() refreshes the numbers.
  function buildTable(t) {
    var qi = t.state.query, table = t.ui.table;
    t.root.setAttribute("data-query", String(qi));
    for (var i = 0; i < t.n; i++) { t.ui.chipEls[i].classList.toggle("slw-query", i === qi); }
    table.textContent = "";
    t.rows = [];
    var thead = el("thead");
    var hr = el("tr");
    var heads = ["word"];
    for (var d = 0; d < t.dim; d++) { heads.push("key k" + (d + 1)); }
    heads = heads.concat(["score q\u00b7k", "e^score", "share", ""]);
    heads.forEach(function (h) { hr.appendChild(el("th", null, h)); });
    thead.appendChild(hr);
    table.appendChild(thead);
    var tb = el("tbody");
    for (var j = 0; j < t.n; j++) { tb.appendChild(toyRow(t, j)); }
    table.appendChild(tb);
    updateToy(t);
  }
  // One word's row: its key's inputs, then its score, e^score, share and bar (masked after the query).
  function toyRow(t, j) {
    var qi = t.state.query, tr = el("tr", "slw-toy-row");
    tr.setAttribute("data-word", t.words[j]);
    tr.setAttribute("data-index", String(j));
    tr.appendChild(el("td", "slw-toy-word", t.words[j]));
    for (var d = 0; d < t.dim; d++) {
      var td = el("td");
      td.appendChild(vecInput(t.state.k[j], d, "slw-k", function () { updateToy(t); }));
      tr.appendChild(td);
    }
    var cells = {
      tr: tr, score: el("td", "slw-toy-score"), exp: el("td", "slw-toy-exp"),
      share: el("td", "slw-toy-share"), fill: el("span", "slw-bar-fill")
    };
    tr.appendChild(cells.score); tr.appendChild(cells.exp); tr.appendChild(cells.share);
    var bt = el("td");
    if (j <= qi) {
      var bar = el("span", "slw-bar slw-bar-wide");
      bar.appendChild(cells.fill);
      bt.appendChild(bar);
      if (j === qi) { tr.classList.add("slw-query-row"); }
    } else {
      tr.classList.add("slw-future");
      cells.score.textContent = "\u2212\u221e (masked)";
      cells.exp.textContent = "0";
      cells.share.textContent = "0%";
      tr.setAttribute("data-share", "0");
    }
    tr.appendChild(bt);
    t.rows.push(cells);
    return tr;
  }

  // Refresh the numbers of the rows the query sees, and the foot's total.
  function updateToy(t) {
    var qi = t.state.query, qv = t.state.q[qi];
    var r = toyShares(t);
    var total = 0;
    for (var j = 0; j <= qi; j++) {
      var c = t.rows[j];
      var parts = [];
      for (var d = 0; d < t.dim; d++) { parts.push(num(qv[d]) + "\u00d7" + num(t.state.k[j][d])); }
      c.score.textContent = r.scores[j].toFixed(2);
      c.score.title = parts.join(" + ") + " = " + r.scores[j].toFixed(4);
      c.exp.textContent = fmtBig(r.rawExp[j]);
      c.share.textContent = pct(r.shares[j]);
      c.fill.style.width = (100 * r.shares[j]).toFixed(1) + "%";
      c.tr.setAttribute("data-score", String(r.scores[j]));
      c.tr.setAttribute("data-share", String(r.shares[j]));
      total += r.rawExp[j];
    }
    t.ui.foot.textContent = "share = e^score \u00f7 the total of e^score over the words the query can see (" +
      fmtBig(total) + "). The real model uses 64 numbers per query and key, and divides each " +
      "score by \u221a64 = 8 before the softmax.";
  }

  function renderToy(t) { renderQuery(t); buildTable(t); }

  function mountToy(root, data) {
    var t = toyView(root, data);
    buildToy(t);
    t.ui.chips.addEventListener("click", function (ev) {
      var b = ev.target && ev.target.closest ? ev.target.closest(".slw-chip") : null;
      if (!b) { return; }
      t.state.query = parseInt(b.getAttribute("data-index"), 10);
      renderToy(t);
    });
    t.ui.reset.addEventListener("click", function () {
      t.state.q = copy(t.original.q);
      t.state.k = copy(t.original.k);
      renderToy(t);
    });
    renderToy(t);
  }

  // ------------------------------------------------------------------ mount
  function mount(rootId) {
    var root = document.getElementById(rootId);
    var src = document.getElementById(rootId + "-data");
    if (!root || !src || root.getAttribute("data-slw-mounted") === "1") { return; }
    var data;
    try {
      data = JSON.parse(src.textContent);
    } catch (e) {
      root.textContent = "storylens widget: could not read its data (" + e.message + ")";
      return;
    }
    root.setAttribute("data-slw-mounted", "1");
    if (data.kind === "toy") {
      mountToy(root, data);
      root.setAttribute("data-slw-ready", "1");
      return;
    }
    window.StorylensExport.inflate(data.att.deflate).then(function (buf) {
      data.att.values = data.att.bits === 16 ? new Uint16Array(buf) : new Uint8Array(buf);
      mountAttention(root, data);
      root.setAttribute("data-slw-ready", "1");
    }).catch(function (e) {
      root.textContent = "storylens widget: could not unpack its attention data (" + e.message + ")";
    });
  }

  window.StorylensWidget = { version: VERSION, mount: mount };
})();
