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
  function mountAttention(root, data) {
    var tokens = data.tokens;
    var T = tokens.length;
    var nB = data.nBlock, nH = data.nHead;
    var levels = data.att.levels, vals = data.att.values;  // every head's lower triangle, quantised
    var tri = T * (T + 1) / 2;
    var dec = data.att.bits === 16 ? 5 : 3;  // shown decimals: the quantisation step's
    var state = {
      block: data.block, head: data.head, query: data.query, mode: data.mode || "one", from: 0
    };
    var allAtOnce = nB * nH <= data.allAtOnce;

    // weights of query q over keys 0..q, exactly as embedded (level / levels)
    function row(b, h, q) {
      var off = (b * nH + h) * tri + q * (q + 1) / 2;
      var out = new Array(q + 1);
      for (var i = 0; i <= q; i++) { out[i] = vals[off + i] / levels; }
      return out;
    }
    function fmt(w) { return w.toFixed(dec); }
    function exact(w) { return String(w); }  // data-weight: the shown weight, every digit

    root.textContent = "";
    root.classList.add("slw-attention");

    var header = el("div", "slw-header");
    header.appendChild(el("div", "slw-title", data.title));
    root.appendChild(header);

    // controls
    var controls = el("div", "slw-controls");
    var lb = el("label", "slw-ctl", "Block ");
    var selB = el("select", "slw-block");
    for (var b = 0; b < nB; b++) { option(selB, b, "L" + (b + 1)); }
    lb.appendChild(selB);
    var lh = el("label", "slw-ctl", "Head ");
    var selH = el("select", "slw-head");
    for (var h = 0; h < nH; h++) { option(selH, h, "H" + (h + 1)); }
    lh.appendChild(selH);
    var badge = el("span", "slw-badge");
    var modeOne = el("button", "slw-mode slw-mode-one", "One head");
    var modeAll = el("button", "slw-mode slw-mode-all", allAtOnce ? "All " + (nB * nH) + " heads" : "All heads of the block");
    var modeMaps = el("button", "slw-mode slw-mode-maps", "Maps");
    modeMaps.title = "every head of the block as a map of a window of tokens";
    modeOne.type = "button"; modeAll.type = "button"; modeMaps.type = "button";
    controls.appendChild(lb); controls.appendChild(lh); controls.appendChild(badge);
    controls.appendChild(modeOne); controls.appendChild(modeAll); controls.appendChild(modeMaps);
    controls.appendChild(window.StorylensExport.buttons(viewSvg, viewName));
    root.appendChild(controls);

    var info = el("div", "slw-info");
    root.appendChild(info);
    // ---- replay: a generated story, written token by token (data.replay.start = first new token).
    // The page opens on the whole story; the buttons' marks are drawn (inline SVG) beside plain
    // ASCII words, so no font can turn them into empty boxes.
    var replay = data.replay || null;
    var written = T - 1;
    if (replay) {
      var rp = el("div", "slw-replay");
      var bFirst = rpButton("slw-rp-first", "first", "Prompt", "Back to the prompt alone");
      var bPrev = rpButton("slw-rp-prev", "prev", "Back", "Unwrite the last token");
      var bNext = rpButton("slw-rp-next", "next", "Step", "Write the next token");
      var bPlay = rpButton("slw-rp-play", "play", "Play", "Write the rest token by token");
      var bLast = rpButton("slw-rp-last", "last", "Whole story", "Show the whole story");
      var rpInfo = el("span", "slw-rp-info");
      [bFirst, bPrev, bNext, bPlay, bLast].forEach(function (b) { rp.appendChild(b); });
      rp.appendChild(rpInfo);
      root.insertBefore(rp, info);
      var timer = null;
      var setPlaying = function (on) {
        bPlay.replaceChild(icon(on ? "pause" : "play"), bPlay.firstChild);
        bPlay.lastChild.textContent = on ? "Pause" : "Play";
      };
      var setWritten = function (n) {
        written = Math.max(replay.start - 1, Math.min(T - 1, n));
        state.query = written;
        render();
        reveal();
      };
      var stop = function () {
        if (timer !== null) { clearInterval(timer); timer = null; }
        setPlaying(false);
      };
      bFirst.addEventListener("click", function () { stop(); setWritten(0); });
      bPrev.addEventListener("click", function () { stop(); setWritten(written - 1); });
      bNext.addEventListener("click", function () { stop(); setWritten(written + 1); });
      bLast.addEventListener("click", function () { stop(); setWritten(T - 1); });
      bPlay.addEventListener("click", function () {
        if (timer !== null) { stop(); return; }
        if (written >= T - 1) { setWritten(0); }
        setPlaying(true);
        timer = setInterval(function () {
          if (written >= T - 1) { stop(); return; }
          setWritten(written + 1);
        }, 350);
      });
    }

    var body = el("div", "slw-body");
    var textBox = el("div", "slw-tokens");
    textBox.tabIndex = 0;
    textBox.setAttribute("role", "listbox");
    textBox.setAttribute("aria-label", "story tokens: click one to make it the query");
    var side = el("div", "slw-side");
    body.appendChild(textBox); body.appendChild(side);
    root.appendChild(body);

    var hover = el("div", "slw-hover", "Hover a token to read its weight.");
    root.appendChild(hover);

    var grid = el("div", "slw-grid");
    root.appendChild(grid);

    root.appendChild(el("div", "slw-note",
      "Shading is relative to the largest weight in the row; tokens after the query are " +
      "masked (their share is exactly 0). Weights are embedded at " + data.att.bits + " bits: each is within " +
      data.maxError.toExponential(1) + " of the recorded one."));

    // token spans
    var spans = new Array(T);
    for (var i = 0; i < T; i++) {
      var t = tokens[i];
      var s = el("span", "slw-tok", shown(t));
      s.setAttribute("data-pos", String(i));
      s.setAttribute("role", "option");
      if (i === 0 && /^<.*>$/.test(t)) { s.classList.add("slw-special"); }
      spans[i] = s;
      textBox.appendChild(s);
      var nl = (String(t).match(/\n/g) || []).length;
      for (var k = 0; k < nl; k++) { textBox.appendChild(document.createElement("br")); }
    }

    function describe(pos, w) {
      var d = "\u201c" + compact(tokens[pos]) + "\u201d at position " + pos;
      if (w === null) { return d + ": after the query, masked (share 0)"; }
      return d + ": weight " + fmt(w) + " (" + pct(w) + ")";
    }

    function renderTokens() {
      var q = state.query;
      var w = row(state.block, state.head, q);
      var max = 0;
      for (var i = 0; i <= q; i++) { if (w[i] > max) { max = w[i]; } }
      for (i = 0; i < T; i++) {
        var s = spans[i];
        s.classList.toggle("slw-unwritten", i > written);  // replay: not written yet
        s.classList.toggle("slw-query", i === q);
        s.setAttribute("aria-selected", i === q ? "true" : "false");
        if (i <= q) {
          var c = shade(w[i], max);
          s.style.backgroundColor = c.bg;
          s.classList.toggle("slw-dark", c.dark);
          s.classList.remove("slw-future");
          s.setAttribute("data-weight", exact(w[i]));
          s.title = describe(i, w[i]);
        } else {
          s.style.backgroundColor = "";
          s.classList.remove("slw-dark");
          s.classList.add("slw-future");
          s.removeAttribute("data-weight");
          s.title = describe(i, null);
        }
      }
      return w;
    }

    function renderSide(w) {
      side.textContent = "";
      var q = state.query;
      side.appendChild(el("div", "slw-side-title",
        "Top " + Math.min(10, q + 1) + " of " + (q + 1) + " for " +
        headLabel(state.block, state.head)));
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
        li.appendChild(el("span", "slw-top-tok", compact(tokens[pos])));
        li.appendChild(el("span", "slw-top-pos", "#" + pos));
        var bar = el("span", "slw-bar");
        var fill = el("span", "slw-bar-fill");
        fill.style.width = (100 * w[pos] / max).toFixed(1) + "%";
        bar.appendChild(fill);
        li.appendChild(bar);
        li.appendChild(el("span", "slw-top-w", fmt(w[pos])));
        li.title = describe(pos, w[pos]);
        list.appendChild(li);
      }
      side.appendChild(list);
      var total = 0;
      for (i = 0; i <= q; i++) { total += w[i]; }
      side.appendChild(el("div", "slw-sum", "Row sum: " + total.toFixed(4)));
    }

    function renderGrid() {
      grid.textContent = "";
      if (state.mode !== "all") { grid.hidden = true; return; }
      grid.hidden = false;
      grid.style.gridTemplateColumns = "repeat(" + nH + ", minmax(0, 1fr))";
      var q = state.query;
      for (var b = 0; b < nB; b++) {
        if (!allAtOnce && b !== state.block) { continue; }
        for (var h = 0; h < nH; h++) {
          var w = row(b, h, q);
          var max = 0, best = [];
          for (var i = 0; i <= q; i++) { if (w[i] > max) { max = w[i]; } best.push(i); }
          best.sort(function (x, y) { return w[y] - w[x] || x - y; });
          var panel = el("div", "slw-panel");
          panel.setAttribute("data-block", String(b));
          panel.setAttribute("data-head", String(h));
          panel.setAttribute("data-label", headLabel(b, h));
          if (b === state.block && h === state.head) { panel.classList.add("slw-panel-sel"); }
          panel.title = headLabel(b, h) + ": click to show this head on the story";
          panel.appendChild(el("div", "slw-panel-label", headLabel(b, h)));
          var strip = el("div", "slw-strip");
          for (i = 0; i <= q; i++) {
            var cell = el("span", "slw-cell");
            cell.style.backgroundColor = shade(w[i], max).bg;
            cell.setAttribute("data-pos", String(i));
            cell.setAttribute("data-weight", exact(w[i]));
            cell.title = headLabel(b, h) + ": " + describe(i, w[i]);
            strip.appendChild(cell);
          }
          panel.appendChild(strip);
          var tops = el("div", "slw-panel-top");
          for (var r = 0; r < Math.min(3, best.length); r++) {
            var p = best[r];
            var item = el("span", "slw-panel-item", compact(tokens[p]) + " " + w[p].toFixed(3));
            item.setAttribute("data-pos", String(p));
            tops.appendChild(item);
          }
          panel.appendChild(tops);
          grid.appendChild(panel);
        }
      }
    }

    // ---- maps: every head of one block over a window of tokens, each token labelled
    var MAP_N = Math.min(T, 32), CELL = 14, LABEL_PX = 11;
    var maps = el("div", "slw-maps");
    var mapNav = el("div", "slw-map-nav");
    var mapPrev = el("button", "slw-mode slw-map-prev", "\u2190 earlier");
    var mapNext = el("button", "slw-mode slw-map-next", "later \u2192");
    var mapFrom = el("input", "slw-map-from");
    mapFrom.type = "number"; mapFrom.min = "0"; mapFrom.max = String(T - MAP_N); mapFrom.value = "0";
    var mapLab = el("label", "slw-ctl", "tokens from ");
    mapLab.appendChild(mapFrom);
    mapPrev.type = "button"; mapNext.type = "button";
    mapNav.appendChild(mapPrev); mapNav.appendChild(mapLab); mapNav.appendChild(mapNext);
    var mapInfo = el("span", "slw-map-info");
    mapNav.appendChild(mapInfo);
    var mapGrid = el("div", "slw-map-grid");
    maps.appendChild(mapNav); maps.appendChild(mapGrid);
    root.insertBefore(maps, grid);

    // viridis (matplotlib's), 9 stops, on the report's power scale (gamma 0.5), 0 to 1
    var VIRIDIS = [[68, 1, 84], [71, 44, 122], [59, 81, 139], [44, 113, 142], [33, 144, 141],
      [39, 173, 129], [92, 200, 99], [170, 220, 50], [253, 231, 37]];
    function viridis(w) {
      var x = Math.sqrt(Math.max(0, Math.min(1, w))) * 8, i = Math.min(7, Math.floor(x)), f = x - i;
      var a = VIRIDIS[i], b = VIRIDIS[i + 1];
      return "rgb(" + [0, 1, 2].map(function (k) { return Math.round(a[k] + f * (b[k] - a[k])); }).join(",") + ")";
    }
    var MASKED = "#262626";
    function mapLabels() {
      var out = [];
      for (var i = state.from; i < state.from + MAP_N; i++) { out.push(compact(tokens[i])); }
      return out;
    }
    function mapFill(b, h) {
      var cache = {};
      return function (r, c) {
        var q = state.from + r, k = state.from + c;
        if (k > q) { return MASKED; }
        if (!cache[q]) { cache[q] = row(b, h, q); }
        return viridis(cache[q][k]);
      };
    }
    function mapSpec(b, h) {
      return { rows: MAP_N, cols: MAP_N, fill: mapFill(b, h), rowLabels: mapLabels(), colLabels: mapLabels(),
        title: headLabel(b, h), cell: [CELL, CELL], size: LABEL_PX };
    }
    function renderMaps() {
      maps.hidden = state.mode !== "maps";
      if (maps.hidden) { return; }
      mapFrom.value = String(state.from);
      mapInfo.textContent = " block L" + (state.block + 1) + ", tokens " + state.from + " to " +
        (state.from + MAP_N - 1) + " of " + T + "; rows: queries, columns: keys; viridis on a power scale, 0 to 1; " +
        "dark grey: masked. Click a map to select its head.";
      mapGrid.textContent = "";
      for (var h = 0; h < nH; h++) {
        var fig = el("div", "slw-map");
        fig.setAttribute("data-block", String(state.block));
        fig.setAttribute("data-head", String(h));
        fig.setAttribute("data-label", headLabel(state.block, h));
        if (h === state.head) { fig.classList.add("slw-panel-sel"); }
        var img = new Image();
        img.alt = headLabel(state.block, h) + ": attention map, tokens " + state.from + " to " + (state.from + MAP_N - 1);
        img.src = "data:image/svg+xml;charset=utf-8," + encodeURIComponent(window.StorylensExport.gridSvg(mapSpec(state.block, h)));
        fig.appendChild(img);
        mapGrid.appendChild(fig);
      }
    }
    function setFrom(v) {
      state.from = Math.max(0, Math.min(T - MAP_N, isNaN(v) ? 0 : v));
      render();
    }
    mapPrev.addEventListener("click", function () { setFrom(state.from - MAP_N); });
    mapNext.addEventListener("click", function () { setFrom(state.from + MAP_N); });
    mapFrom.addEventListener("change", function () { setFrom(parseInt(mapFrom.value, 10)); });
    mapGrid.addEventListener("click", function (ev) {
      var fig = ev.target && ev.target.closest ? ev.target.closest(".slw-map") : null;
      if (!fig) { return; }
      state.head = parseInt(fig.getAttribute("data-head"), 10);
      render();
    });

    // ---- what the PNG and SVG buttons save: the view on screen
    function viewName() {
      var base = "attention-" + headLabel(state.block, state.head);
      if (state.mode === "maps") { return "attention-maps-L" + (state.block + 1) + "-from" + state.from; }
      return base + "-query" + state.query + (state.mode === "all" ? "-heads" : "");
    }
    function viewSvg() {
      var X = window.StorylensExport, q = state.query;
      if (state.mode === "maps") {
        var svgs = [];
        for (var h = 0; h < nH; h++) { svgs.push(X.gridSvg(mapSpec(state.block, h))); }
        return stack(svgs, 2);
      }
      if (state.mode === "all") {
        var heads = [];
        for (var b = 0; b < nB; b++) {
          if (!allAtOnce && b !== state.block) { continue; }
          for (var hh = 0; hh < nH; hh++) { heads.push([b, hh, row(b, hh, q)]); }
        }
        var keys = [];
        for (var k = 0; k <= q; k++) { keys.push(k % 10 === 0 ? String(k) : ""); }
        return X.gridSvg({ rows: heads.length, cols: q + 1, cell: [Math.max(3, Math.min(14, 900 / (q + 1))), 14],
          rowLabels: heads.map(function (x) { return headLabel(x[0], x[1]); }), colLabels: [], size: 11,
          title: "Query \u201c" + compact(tokens[q]) + "\u201d (position " + q + "): its row in every head",
          fill: function (r, c) { var w = heads[r][2], m = Math.max.apply(null, w); return shade(w[c], m).bg; } });
      }
      var w = row(state.block, state.head, q), max = Math.max.apply(null, w);
      var items = [];
      for (var i = 0; i < T; i++) {
        items.push({ text: shown(tokens[i]), fill: i <= q ? shade(w[i], max).bg : "#f0f0f0", bold: i === q });
      }
      return X.tokensSvg(items, { title: data.title + ": " + headLabel(state.block, state.head) + ", query " + q, width: 900 });
    }
    // several SVG documents side by side, `per` to a row (sizes read from their own headers)
    function stack(svgs, per) {
      var X = window.StorylensExport, x = 0, y = 0, rowH = 0, width = 0, body = "";
      svgs.forEach(function (s, i) {
        var m = /width="(\d+)" height="(\d+)"/.exec(s), w = +m[1], hgt = +m[2];
        if (i % per === 0 && i > 0) { y += rowH + 10; x = 0; rowH = 0; }
        body += '<svg x="' + x + '" y="' + y + '"' + s.slice(4);
        x += w + 10; rowH = Math.max(rowH, hgt); width = Math.max(width, x);
      });
      return X.doc(width, y + rowH, body);
    }

    function render() {
      selB.value = String(state.block);
      selH.value = String(state.head);
      badge.textContent = headLabel(state.block, state.head);
      modeOne.setAttribute("aria-pressed", state.mode === "one" ? "true" : "false");
      modeAll.setAttribute("aria-pressed", state.mode === "all" ? "true" : "false");
      modeMaps.setAttribute("aria-pressed", state.mode === "maps" ? "true" : "false");
      root.setAttribute("data-block", String(state.block));
      root.setAttribute("data-head", String(state.head));
      root.setAttribute("data-query", String(state.query));
      root.setAttribute("data-mode", state.mode);
      root.setAttribute("data-written", String(written));
      if (replay) {
        var k = written - replay.start + 1, nNew = T - replay.start;
        rpInfo.textContent = k >= nNew
          ? "The whole story: " + nNew + " new tokens after a " + replay.start + "-token prompt. " +
            "Go back to the Prompt, then Step or Play to watch the model write it."
          : k > 0
            ? "Written " + k + " of " + nNew + " new tokens. Each one is shown with the " +
              "attention it gave while the model read it (recorded during KV-cached generation)."
            : "The prompt (" + replay.start + " tokens). Step or Play to watch the model write.";
      }
      info.textContent = "";
      info.appendChild(document.createTextNode("Query: "));
      info.appendChild(el("span", "slw-info-tok", compact(tokens[state.query])));
      info.appendChild(document.createTextNode(
        " (position " + state.query + "), looking at the " + (state.query + 1) +
        " tokens up to itself with " + headLabel(state.block, state.head) +
        ". Click any token to make it the query."));
      var w = renderTokens();
      renderSide(w);
      renderGrid();
      renderMaps();
    }

    // Scroll the token box (only the box, never the page) so the query is in view.
    function reveal() {
      var s = spans[state.query];
      var top = s.offsetTop, bottom = top + s.offsetHeight;
      if (top < textBox.scrollTop || bottom > textBox.scrollTop + textBox.clientHeight) {
        textBox.scrollTop = Math.max(0, top - textBox.clientHeight / 2);
      }
    }

    textBox.addEventListener("click", function (ev) {
      var t = ev.target;
      if (!t || !t.getAttribute) { return; }
      var p = t.getAttribute("data-pos");
      if (p === null || parseInt(p, 10) > written) { return; }
      state.query = parseInt(p, 10);
      render();
    });
    textBox.addEventListener("keydown", function (ev) {
      if (ev.key === "ArrowRight" && state.query < written) { state.query++; }
      else if (ev.key === "ArrowLeft" && state.query > 0) { state.query--; }
      else { return; }
      ev.preventDefault();
      render();
      reveal();
    });
    function onHover(ev) {
      var t = ev.target;
      if (!t || !t.getAttribute) { return; }
      var p = t.getAttribute("data-pos");
      if (p === null) { return; }
      var pos = parseInt(p, 10);
      var wt = t.getAttribute("data-weight");
      var label = t.classList.contains("slw-cell") ? t.title : null;
      hover.textContent = label || describe(pos, wt === null ? null : parseFloat(wt));
    }
    textBox.addEventListener("mouseover", onHover);
    grid.addEventListener("mouseover", onHover);
    side.addEventListener("mouseover", function (ev) {
      var li = ev.target && ev.target.closest ? ev.target.closest(".slw-top-item") : null;
      if (li) { hover.textContent = li.title; }
    });
    grid.addEventListener("click", function (ev) {
      var panel = ev.target && ev.target.closest ? ev.target.closest(".slw-panel") : null;
      if (!panel) { return; }
      state.block = parseInt(panel.getAttribute("data-block"), 10);
      state.head = parseInt(panel.getAttribute("data-head"), 10);
      render();
    });
    selB.addEventListener("change", function () { state.block = parseInt(selB.value, 10); render(); });
    selH.addEventListener("change", function () { state.head = parseInt(selH.value, 10); render(); });
    modeOne.addEventListener("click", function () { state.mode = "one"; render(); });
    modeAll.addEventListener("click", function () { state.mode = "all"; render(); });
    modeMaps.addEventListener("click", function () { state.mode = "maps"; render(); });

    render();
    reveal();
  }

  // ------------------------------------------------------------------ toy view
  function mountToy(root, data) {
    var words = data.words;
    var n = words.length;
    var dim = data.q.length ? data.q[0].length : 2;
    var original = { q: JSON.parse(JSON.stringify(data.q)), k: JSON.parse(JSON.stringify(data.k)) };
    var state = { q: JSON.parse(JSON.stringify(data.q)), k: JSON.parse(JSON.stringify(data.k)), query: data.query };

    root.textContent = "";
    root.classList.add("slw-toy");
    var header = el("div", "slw-header");
    header.appendChild(el("div", "slw-title", data.title));
    header.appendChild(window.StorylensExport.buttons(function () {
      // the shares as the page shows them: the query's row over the words it can see
      var r = compute(), max = Math.max.apply(null, r.shares);
      var items = words.map(function (w, j) {
        return { text: j <= state.query ? w + " " + pct(r.shares[j]) : w, fill: j <= state.query ? shade(r.shares[j], max).bg : "#f0f0f0", bold: j === state.query };
      });
      return window.StorylensExport.tokensSvg(items, { title: data.title + ": the shares of \u201c" + words[state.query] + "\u201d", width: 900 });
    }, function () { return "toy-attention-" + words[state.query]; }));
    root.appendChild(header);
    root.appendChild(el("div", "slw-info",
      "Click a word to make it the query. Each word has a query (the question it asks) and a " +
      "key (the card it holds up), " + dim + " numbers each, set by hand. Score = q\u00b7k " +
      "(multiply and add); the softmax turns the scores into shares that add to 100%. " +
      "Words after the query are masked."));

    var chips = el("div", "slw-chips");
    root.appendChild(chips);
    var chipEls = [];
    for (var i = 0; i < n; i++) {
      var c = el("button", "slw-chip", words[i]);
      c.type = "button";
      c.setAttribute("data-index", String(i));
      chips.appendChild(c);
      chipEls.push(c);
    }

    var qline = el("div", "slw-qline");
    root.appendChild(qline);

    var table = el("table", "slw-toy-table");
    root.appendChild(table);
    var foot = el("div", "slw-note");
    root.appendChild(foot);
    var reset = el("button", "slw-mode slw-reset", "Reset to the hand-set numbers");
    reset.type = "button";
    root.appendChild(reset);

    function num(v) {
      var r = Math.round(v * 1000) / 1000;
      return String(r);
    }

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

    function compute() {
      var qi = state.query, qv = state.q[qi];
      var scores = [], maxS = -Infinity;
      for (var j = 0; j <= qi; j++) {
        var s = 0;
        for (var d = 0; d < dim; d++) { s += qv[d] * state.k[j][d]; }
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

    function renderQuery() {
      qline.textContent = "";
      var qi = state.query;
      qline.appendChild(document.createTextNode("Query word "));
      qline.appendChild(el("b", "slw-info-tok", words[qi]));
      qline.appendChild(document.createTextNode(" asks q = ("));
      for (var d = 0; d < dim; d++) {
        if (d) { qline.appendChild(document.createTextNode(", ")); }
        qline.appendChild(vecInput(state.q[qi], d, "slw-q", update));
      }
      qline.appendChild(document.createTextNode(")"));
    }

    var rows = [];  // per word: {tr, score, exp, share, fill}

    // Rebuild the table (when the query changes): inputs are created once per build,
    // so typing in one keeps its focus while update() refreshes the numbers.
    function buildTable() {
      var qi = state.query;
      root.setAttribute("data-query", String(qi));
      for (var i = 0; i < n; i++) { chipEls[i].classList.toggle("slw-query", i === qi); }
      table.textContent = "";
      rows = [];
      var thead = el("thead");
      var hr = el("tr");
      var heads = ["word"];
      for (var d = 0; d < dim; d++) { heads.push("key k" + (d + 1)); }
      heads = heads.concat(["score q\u00b7k", "e^score", "share", ""]);
      heads.forEach(function (h) { hr.appendChild(el("th", null, h)); });
      thead.appendChild(hr);
      table.appendChild(thead);
      var tb = el("tbody");
      for (var j = 0; j < n; j++) {
        var tr = el("tr", "slw-toy-row");
        tr.setAttribute("data-word", words[j]);
        tr.setAttribute("data-index", String(j));
        tr.appendChild(el("td", "slw-toy-word", words[j]));
        for (d = 0; d < dim; d++) {
          var td = el("td");
          td.appendChild(vecInput(state.k[j], d, "slw-k", update));
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
        rows.push(cells);
        tb.appendChild(tr);
      }
      table.appendChild(tb);
      update();
    }

    function fmtBig(v) { return v < 1e6 ? v.toFixed(2) : v.toExponential(2); }

    function update() {
      var qi = state.query;
      var r = compute();
      var qv = state.q[qi];
      var total = 0;
      for (var j = 0; j <= qi; j++) {
        var c = rows[j];
        var parts = [];
        for (var d = 0; d < dim; d++) { parts.push(num(qv[d]) + "\u00d7" + num(state.k[j][d])); }
        c.score.textContent = r.scores[j].toFixed(2);
        c.score.title = parts.join(" + ") + " = " + r.scores[j].toFixed(4);
        c.exp.textContent = fmtBig(r.rawExp[j]);
        c.share.textContent = pct(r.shares[j]);
        c.fill.style.width = (100 * r.shares[j]).toFixed(1) + "%";
        c.tr.setAttribute("data-score", String(r.scores[j]));
        c.tr.setAttribute("data-share", String(r.shares[j]));
        total += r.rawExp[j];
      }
      foot.textContent = "share = e^score \u00f7 the total of e^score over the words the query can see (" +
        fmtBig(total) + "). The real model uses 64 numbers per query and key, and divides each " +
        "score by \u221a64 = 8 before the softmax.";
    }

    function render() { renderQuery(); buildTable(); }

    chips.addEventListener("click", function (ev) {
      var b = ev.target && ev.target.closest ? ev.target.closest(".slw-chip") : null;
      if (!b) { return; }
      state.query = parseInt(b.getAttribute("data-index"), 10);
      render();
    });
    reset.addEventListener("click", function () {
      state.q = JSON.parse(JSON.stringify(original.q));
      state.k = JSON.parse(JSON.stringify(original.k));
      render();
    });
    render();
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
