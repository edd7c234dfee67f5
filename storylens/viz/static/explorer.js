/* storylens corpus explorer. Inlined into explore.html by storylens.viz.explorer, after export.js;
 * no network.
 *
 * Four views of one score run, all from the embedded JSON:
 *   the head table  every column, sortable, filtered by an expression or by the flag;
 *   the grid        one column over layers x heads, coloured, the value in each cell;
 *   the examples    the chosen head's top examples for one detector (at first its strongest),
 *                   tokens shaded by attention, the most-attended key always among them;
 *   the map         the chosen example's attention over those tokens, as a bar strip.
 * Each view draws its SVG export from the same colour and label functions it draws the screen
 * with. Story text reaches the DOM only through textContent.
 */
(function () {
  "use strict";
  if (window.StorylensExplorer) { return; }
  var X = window.StorylensExport;
  var WEIGHT_SCALE = 10000;  // weights are embedded as whole numbers of 1e-4
  var CELL = [38, 28], CELL_FONT = 10;  // the grid: legible at 48 x 16 heads
  var TOKEN_FONT = 14, BAR_FONT = 11, BAR_H = 90;
  var VIRIDIS = ["#440154", "#482878", "#3e4989", "#31688e", "#26828e", "#1f9e89", "#35b779", "#6ece58", "#b5de2b", "#fde725"];
  var SHADE = [253, 141, 60];  // a token's background at weight 1 (black text stays readable)
  var NONE_FILL = "#eeeeee", NONE_INK = "#57606a";
  var FLAG = "dormant";
  var GAP = "...";  // between the key's tokens and the query's, where tokens are left out

  // ------------------------------------------------------------------ small helpers
  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) { e.className = cls; }
    if (text !== undefined && text !== null) { e.textContent = String(text); }
    return e;
  }

  function isNum(v) { return typeof v === "number" && isFinite(v); }

  /* A table value for reading: 4 decimals for scores, fewer for large numbers, n/a for none. */
  function fmt(v) {
    if (!isNum(v)) { return v === null || v === undefined ? "n/a" : String(v); }
    if (Number.isInteger(v)) { return String(v); }
    var a = Math.abs(v);
    return v.toFixed(a < 10 ? 4 : a < 1000 ? 2 : 0);
  }

  /* A grid cell's value: three characters or so, so it fits a 38 px cell. */
  function cellText(v) {
    if (!isNum(v)) { return "n/a"; }
    var a = Math.abs(v);
    return v.toFixed(a < 10 ? 2 : a < 100 ? 1 : 0);
  }

  /* A token's text made visible: newlines and tabs as symbols, an empty token as a sign. */
  function shown(t) {
    var s = String(t).replace(/\r/g, "").replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5");
    return s.length ? s : "\u2205";
  }

  /* A token as a bar label: trimmed, a pure-space token as a visible space sign, at most 12 characters. */
  function tick(t) {
    var s = shown(t).trim();
    if (!s.length) { return "\u2423"; }
    return s.length > 12 ? s.slice(0, 11) + "\u2026" : s;
  }

  function hex(rgb) {
    return "#" + rgb.map(function (x) { return ("0" + Math.round(x).toString(16)).slice(-2); }).join("");
  }

  function parseHex(h) { return [1, 3, 5].map(function (i) { return parseInt(h.slice(i, i + 2), 16); }); }

  /* t in [0, 1] on the viridis scale, and the ink that reads on it. */
  function viridis(t) {
    t = Math.max(0, Math.min(1, t));
    var x = t * (VIRIDIS.length - 1), i = Math.min(VIRIDIS.length - 2, Math.floor(x)), f = x - i;
    var a = parseHex(VIRIDIS[i]), b = parseHex(VIRIDIS[i + 1]);
    return hex([0, 1, 2].map(function (k) { return a[k] + f * (b[k] - a[k]); }));
  }
  function inkOn(t) { return t > 0.62 ? "#000000" : "#ffffff"; }

  /* A token's background for attention weight w: white to orange. */
  function shade(w) {
    w = Math.max(0, Math.min(1, w));
    return hex(SHADE.map(function (c) { return 255 + w * (c - 255); }));
  }

  function slug(s) { return String(s).replace(/[^A-Za-z0-9_.-]+/g, "-").replace(/^-+|-+$/g, "") || "view"; }

  // ------------------------------------------------------------------ the filter language
  /* "prev_token > 0.5", "norm_marker >= 0.1 and output_share < 0.02", "layer = 3",
   * "dormant = true" (the head is flagged), with and, or, not
   * and parentheses. Returns a function of a row (column -> value), or throws an Error whose
   * message is one line. A comparison with a missing value (n/a) is false. */
  var LEX = /\s*(?:(<=|>=|==|!=|=|<|>)|([()])|"([^"]*)"|'([^']*)'|(-?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)(?![A-Za-z_])|([A-Za-z_][A-Za-z0-9_]*))/y;
  var ALIASES = { layer: "block" };

  function lex(src) {
    var out = [], re = new RegExp(LEX.source, "y"), m;
    re.lastIndex = 0;
    while (re.lastIndex < src.length) {
      var at = re.lastIndex;
      if (/^\s*$/.test(src.slice(at))) { break; }
      m = re.exec(src);
      if (!m) { throw new Error("cannot read \u201c" + src.slice(at).trim().slice(0, 20) + "\u201d"); }
      if (m[1]) { out.push({ kind: "op", v: m[1] === "==" ? "=" : m[1] }); }
      else if (m[2]) { out.push({ kind: m[2] }); }
      else if (m[3] !== undefined || m[4] !== undefined) { out.push({ kind: "str", v: m[3] !== undefined ? m[3] : m[4] }); }
      else if (m[5]) { out.push({ kind: "num", v: parseFloat(m[5]) }); }
      else { out.push({ kind: "word", v: m[6] }); }
    }
    return out;
  }

  function compare(a, op, b) {
    switch (op) {
      case "<": return a < b;
      case "<=": return a <= b;
      case ">": return a > b;
      case ">=": return a >= b;
      case "=": return a === b;
      default: return a !== b;
    }
  }

  function flagged(v) { return v === true || v === "True" || v === "true"; }

  function parseFilter(src, numeric, columns) {
    var toks = lex(src), i = 0;
    if (!toks.length) { return function () { return true; }; }
    function peekWord(w) { return toks[i] && toks[i].kind === "word" && toks[i].v.toLowerCase() === w; }
    function fail(what) {
      var got = toks[i] ? (toks[i].v !== undefined ? String(toks[i].v) : toks[i].kind) : "the end";
      throw new Error("expected " + what + ", got \u201c" + got + "\u201d");
    }
    function anyOf() {
      var left = allOf();
      while (peekWord("or")) { i++; left = (function (a, b) { return function (r) { return a(r) || b(r); }; })(left, allOf()); }
      return left;
    }
    function allOf() {
      var left = one();
      while (peekWord("and")) { i++; left = (function (a, b) { return function (r) { return a(r) && b(r); }; })(left, one()); }
      return left;
    }
    function one() {
      if (peekWord("not")) { i++; var inner = one(); return function (r) { return !inner(r); }; }
      if (toks[i] && toks[i].kind === "(") {
        i++;
        var e = anyOf();
        if (!toks[i] || toks[i].kind !== ")") { fail("\u201c)\u201d"); }
        i++;
        return e;
      }
      return comparison();
    }
    function comparison() {
      var t = toks[i];
      if (!t || t.kind !== "word") { fail("a column name"); }
      var asked = ALIASES[t.v.toLowerCase()] || t.v.toLowerCase();
      var name = columns.filter(function (c) { return c.toLowerCase() === asked; })[0];
      if (name === undefined) {
        throw new Error("no column \u201c" + t.v + "\u201d (columns: " + columns.slice(0, 6).join(", ") + ", \u2026)");
      }
      i++;
      var op = toks[i];
      if (!op || op.kind !== "op") { fail("<, <=, >, >=, = or != after " + name); }
      i++;
      var val = toks[i];
      if (!val || (val.kind !== "num" && val.kind !== "str" && val.kind !== "word")) { fail("a value after " + name + " " + op.v); }
      i++;
      if (numeric[name]) {
        if (val.kind !== "num") { throw new Error(name + " holds numbers: compare it with a number"); }
        return function (r) { var v = r[name]; return isNum(v) && compare(v, op.v, val.v); };
      }
      if (op.v !== "=" && op.v !== "!=") { throw new Error(name + " holds text: use = or !="); }
      var want = String(val.v).toLowerCase();
      if (name === FLAG) {
        var on = want === "true" || want === "yes" || want === "1";
        return function (r) { return (flagged(r[name]) === on) === (op.v === "=" || op.v === "=="); };
      }
      return function (r) { return compare(String(r[name]).toLowerCase(), op.v, want); };
    }
    var pred = anyOf();
    if (i < toks.length) { fail("and, or or the end"); }
    return pred;
  }

  // ------------------------------------------------------------------ the page
  /* The page's one object, handed to every function below: what the run says (the columns, the
   * heads as rows of column -> value, which columns are numbers, the examples), what the reader
   * chose (state), the elements the views draw into (ui) and the grid's cells. */
  function explorerView(root, data) {
    var cols = data.columns;
    var heads = data.rows.map(function (vals, index) {
      var r = { index: index };
      cols.forEach(function (c, j) { r[c] = vals[j]; });
      return r;
    });
    var numeric = {};
    cols.forEach(function (c) {
      numeric[c] = c !== "label" && c !== FLAG && heads.every(function (r) { return r[c] === null || isNum(r[c]); });
    });
    var gridColumns = cols.filter(function (c) { return numeric[c] && c !== "block" && c !== "head"; });
    var byPlace = {};
    heads.forEach(function (r) { byPlace[r.block + ":" + r.head] = r; });
    var ex = data.examples;
    return {
      root: root, data: data, cols: cols, nB: data.shape[0], nH: data.shape[1], heads: heads, numeric: numeric,
      gridColumns: gridColumns, byPlace: byPlace, ex: ex, best: bestOf(ex, cols, heads),
      state: {
        head: null, column: gridColumns.indexOf("prev_token") >= 0 ? "prev_token" : gridColumns[0],
        detector: ex && ex.detectors.length ? ex.detectors[0] : null, example: 0,
        sort: { col: null, dir: 1 }, pred: function () { return true; }
      },
      ui: {},
      cells: []  // the grid's: {el, row (null: no head there), b, h}
    };
  }

  /* The best head's score for each detector with examples and a column (for strongest). */
  function bestOf(ex, cols, heads) {
    var best = {};
    if (!ex) { return best; }
    ex.detectors.forEach(function (d) {
      if (cols.indexOf(d) < 0) { return; }
      var vals = heads.map(function (r) { return r[d]; }).filter(isNum);
      if (vals.length) { best[d] = Math.max.apply(null, vals); }
    });
    return best;
  }

  /* A head's strongest detector: of the detectors with examples and a column, the one where its
   * score is the largest share of the best head's score (ties: the first); null where none. */
  function strongest(v, r) {
    var pick = null, top = -Infinity;
    (v.ex ? v.ex.detectors : []).forEach(function (d) {
      if (!(v.best[d] > 0) || !isNum(r[d])) { return; }
      var share = r[d] / v.best[d];
      if (share > top) { top = share; pick = d; }
    });
    return pick;
  }

  function buildMeta(v) {
    v.root.textContent = "";
    v.root.appendChild(el("h1", "sle-title", v.data.title));
    var meta = el("dl", "sle-meta");
    Object.keys(v.data.meta).forEach(function (k) {
      meta.appendChild(el("dt", null, k));
      meta.appendChild(el("dd", null, v.data.meta[k]));
    });
    v.root.appendChild(meta);
  }

  // ---------------------------------------------------------------- the head table
  function buildTable(v) {
    var ui = v.ui;
    var box = el("section", "sle-section sle-table-box");
    box.appendChild(el("h2", null, "Every head"));
    box.appendChild(tableControls(v));
    ui.message = el("div", "sle-filter-msg");
    ui.message.setAttribute("role", "status");
    box.appendChild(ui.message);
    var scroller = el("div", "sle-table-scroll");
    var table = el("table", "sle-table");
    table.appendChild(tableHead(v));
    ui.tbody = el("tbody");
    v.heads.forEach(function (r) { ui.tbody.appendChild(tableRow(v, r)); });
    table.appendChild(ui.tbody);
    scroller.appendChild(table);
    box.appendChild(scroller);
    v.root.appendChild(box);
    ui.filter.addEventListener("input", function () { onFilter(v); });
    ui.flag.addEventListener("change", function () { applyTable(v); });
  }

  /* The filter box, the flag's checkbox and the count of heads matching. */
  function tableControls(v) {
    var ui = v.ui, controls = el("div", "sle-controls");
    ui.filter = el("input", "sle-filter");
    ui.filter.type = "text";
    ui.filter.placeholder = "filter, e.g. prev_token > 0.5 and output_share < 0.02";
    ui.filter.setAttribute("aria-label", "filter the heads");
    ui.filter.spellcheck = false;
    var flagBox = el("label", "sle-flag-label");
    ui.flag = el("input", "sle-flagged");
    ui.flag.type = "checkbox";
    flagBox.appendChild(ui.flag);
    flagBox.appendChild(document.createTextNode(" dormant heads only"));
    ui.count = el("span", "sle-count");
    controls.appendChild(ui.filter);
    controls.appendChild(flagBox);
    controls.appendChild(ui.count);
    var meaning = (v.data.meanings || {})[FLAG];
    if (meaning) { controls.appendChild(el("p", "sle-flag-meaning", "Dormant: " + meaning + ".")); }
    return controls;
  }

  /* The header: a sort button per column (again: the other way). */
  function tableHead(v) {
    var thead = el("thead"), headRow = el("tr");
    v.cols.forEach(function (c) {
      var th = el("th", v.numeric[c] ? "sle-num" : null);
      var b = el("button", "sle-sort", c);
      b.type = "button";
      b.dataset.col = c;
      var means = (v.data.meanings || {})[c];
      b.title = (means ? c + ": " + means + ". " : "") + "Sort by " + c + " (again: the other way)";
      th.setAttribute("aria-sort", "none");
      th.dataset.col = c;
      th.appendChild(b);
      headRow.appendChild(th);
    });
    thead.appendChild(headRow);
    thead.addEventListener("click", function (e) {
      var b = e.target.closest("button.sle-sort");
      if (b) { sortBy(v, b.dataset.col, headRow); }
    });
    return thead;
  }

  /* A head's row (kept on it as r.tr; a click selects the head). */
  function tableRow(v, r) {
    var tr = el("tr", "sle-row");
    tr.dataset.label = r.label;
    v.cols.forEach(function (c) {
      var val = r[c];
      var td = el("td", v.numeric[c] ? "sle-num" : null, c === FLAG ? (flagged(val) ? "dormant" : "") : fmt(val));
      td.dataset.value = val === null || val === undefined ? "" : (Array.isArray(val) ? val.join(",") : String(val));
      tr.appendChild(td);
    });
    r.tr = tr;
    tr.addEventListener("click", function () { select(v, r); });
    return tr;
  }

  function sortBy(v, c, headRow) {
    var s = v.state;
    s.sort = { col: c, dir: s.sort.col === c ? -s.sort.dir : (v.numeric[c] ? -1 : 1) };
    Array.prototype.forEach.call(headRow.children, function (th) {
      th.setAttribute("aria-sort", th.dataset.col !== c ? "none" : s.sort.dir > 0 ? "ascending" : "descending");
    });
    applyTable(v);
  }

  /* The heads in the table's order: by the sorted column, none last both ways, ties by index. */
  function order(v) {
    var c = v.state.sort.col, dir = v.state.sort.dir;
    var rows = v.heads.slice();
    if (c !== null && c !== "label") {
      rows.sort(function (a, b) {
        var x = a[c], y = b[c];
        if (v.numeric[c]) {
          var nx = !isNum(x), ny = !isNum(y);
          if (nx || ny) { return nx === ny ? a.index - b.index : (nx ? 1 : -1); }  // none last, both ways
          return x === y ? a.index - b.index : dir * (x - y);
        }
        var s = String(x === null ? "" : x).localeCompare(String(y === null ? "" : y));
        return s === 0 ? a.index - b.index : dir * s;
      });
    } else if (c === "label" && dir < 0) {
      rows.reverse();  // labels in block and head order, not as text (L10 after L9)
    }
    return rows;
  }

  function applyTable(v) {
    var shownCount = 0;
    order(v).forEach(function (r) {
      var ok = v.state.pred(r) && (!v.ui.flag.checked || flagged(r[FLAG]));
      r.tr.hidden = !ok;
      if (ok) { shownCount++; }
      v.ui.tbody.appendChild(r.tr);
    });
    v.ui.count.textContent = shownCount + " of " + v.heads.length + " heads match";
    v.root.dataset.matches = String(shownCount);
  }

  function onFilter(v) {
    var ui = v.ui;
    try {
      v.state.pred = parseFilter(ui.filter.value, v.numeric, v.cols);
      ui.message.textContent = "";
      ui.filter.classList.remove("sle-bad");
    } catch (err) {
      ui.message.textContent = "Filter not applied: " + err.message;  // the table stays as it was
      ui.filter.classList.add("sle-bad");
      return;
    }
    applyTable(v);
  }

  // ---------------------------------------------------------------- the grid
  function buildGrid(v) {
    var ui = v.ui;
    var box = el("section", "sle-section sle-grid-box");
    box.appendChild(el("h2", null, "Every head at a glance"));
    var controls = el("div", "sle-controls");
    var colSelect = el("select", "sle-column");
    colSelect.setAttribute("aria-label", "the column the grid shows");
    v.gridColumns.forEach(function (c) {
      var o = el("option", null, c);
      o.value = c;
      colSelect.appendChild(o);
    });
    colSelect.value = v.state.column;
    controls.appendChild(el("span", "sle-ctl", "column"));
    controls.appendChild(colSelect);
    ui.legend = el("span", "sle-legend");
    controls.appendChild(ui.legend);
    var gridExport = el("span", "sle-export-slot");
    controls.appendChild(gridExport);
    box.appendChild(controls);
    var scroll = el("div", "sle-grid-scroll");
    scroll.appendChild(gridCells(v));
    box.appendChild(scroll);
    v.root.appendChild(box);
    gridExport.appendChild(X.buttons(function () { return gridSvg(v); }, function () { return "grid-" + slug(v.state.column); }));
    colSelect.addEventListener("change", function () { chooseColumn(v, colSelect.value); });
  }

  /* Layers x heads of buttons, labelled L and H from 1; a click selects the head. */
  function gridCells(v) {
    var grid = el("div", "sle-grid");
    grid.style.gridTemplateColumns = "auto repeat(" + v.nH + ", " + CELL[0] + "px)";
    grid.style.gridAutoRows = CELL[1] + "px";
    grid.appendChild(el("span", "sle-corner"));
    for (var h = 1; h <= v.nH; h++) { grid.appendChild(el("span", "sle-col-label", "H" + h)); }
    for (var b = 1; b <= v.nB; b++) {
      grid.appendChild(el("span", "sle-row-label", "L" + b));
      for (h = 1; h <= v.nH; h++) {
        var r = v.byPlace[b + ":" + h];
        var cell = el("button", "sle-cell");
        cell.type = "button";
        if (r) {
          cell.dataset.label = r.label;
          cell.title = r.label;
          cell.addEventListener("click", (function (row) { return function () { select(v, row); }; })(r));
        } else {
          cell.disabled = true;
        }
        grid.appendChild(cell);
        v.cells.push({ el: cell, row: r || null, b: b, h: h });
      }
    }
    return grid;
  }

  /* The chosen column's range, and each head's fill, ink and label: the screen and the SVG both. */
  function scale(v, c) {
    var vals = v.heads.map(function (r) { return r[c]; }).filter(isNum);
    var lo = vals.length ? Math.min.apply(null, vals) : 0, hi = vals.length ? Math.max.apply(null, vals) : 1;
    function t(x) { return hi > lo ? (x - lo) / (hi - lo) : 0.5; }
    return {
      lo: lo, hi: hi,
      fill: function (r) { return r && isNum(r[c]) ? viridis(t(r[c])) : NONE_FILL; },
      ink: function (r) { return r && isNum(r[c]) ? inkOn(t(r[c])) : NONE_INK; },
      label: function (r) { return r ? cellText(r[c]) : ""; }
    };
  }

  function drawGrid(v) {
    var c = v.state.column, s = scale(v, c);
    v.cells.forEach(function (x) {
      x.el.style.background = s.fill(x.row);
      x.el.style.color = s.ink(x.row);
      x.el.textContent = s.label(x.row);
      if (x.row) { x.el.dataset.value = isNum(x.row[c]) ? String(x.row[c]) : ""; }
    });
    v.ui.legend.textContent = "colour from " + fmt(s.lo) + " (dark) to " + fmt(s.hi) + " (light)";
    v.root.dataset.column = c;
  }

  function gridSvg(v) {
    var s = scale(v, v.state.column);
    function at(r, c) { return v.byPlace[(r + 1) + ":" + (c + 1)]; }
    var rowLabels = [], colLabels = [];
    for (var i = 1; i <= v.nB; i++) { rowLabels.push("L" + i); }
    for (i = 1; i <= v.nH; i++) { colLabels.push("H" + i); }
    return X.gridSvg({
      rows: v.nB, cols: v.nH, cell: CELL, size: CELL_FONT, title: v.state.column, rowLabels: rowLabels, colLabels: colLabels,
      fill: function (r, c) { return s.fill(at(r, c)); },
      ink: function (r, c) { return s.ink(at(r, c)); },
      label: function (r, c) { return s.label(at(r, c)); }
    });
  }

  // ---------------------------------------------------------------- the chosen head
  /* The chosen head's i-th example for the chosen detector, unpacked from the embedded site. */
  function site(v, r, i) {
    var ex = v.ex, e = ex.heads[r.index], pick = e.top[v.state.detector][i], s = e.sites[pick[0]];
    var x = {
      rank: i + 1, value: pick[1], story: s[0], query: s[1], queryAt: s[2], key: s[3], keyWeight: s[4],
      keyToken: ex.tokens[s[5]], tokens: s[6].map(function (t) { return ex.tokens[t]; }),
      weights: s[7].map(function (w) { return w / WEIGHT_SCALE; })
    };
    x.cells = cellsOf(ex, x, s[8]);
    return x;
  }

  /* What an example shows, in story order, as {pos, text, weight (null: after the query), query,
   * key, gap}: where the key lies before the query's window, the tokens around it (up to that
   * window) come first, then a gap mark where tokens are left out, then the query's window. */
  function cellsOf(ex, x, keyWin) {
    var out = [], first = x.query - x.queryAt;
    if (keyWin) {
      var keyAt = keyWin[0], start = x.key - keyAt, n = Math.min(keyWin[1].length, first - start);
      for (var j = 0; j < n; j++) {
        out.push({ pos: start + j, text: ex.tokens[keyWin[1][j]], weight: keyWin[2][j] / WEIGHT_SCALE,
          query: false, key: start + j === x.key, gap: false });
      }
      if (start + n < first) { out.push({ pos: null, text: GAP, weight: null, query: false, key: false, gap: true }); }
    }
    x.tokens.forEach(function (t, j) {
      out.push({ pos: first + j, text: t, weight: j <= x.queryAt ? x.weights[j] : null,
        query: j === x.queryAt, key: first + j === x.key, gap: false });
    });
    return out;
  }

  function exampleTitle(v, r, x) {
    return r.label + " " + v.state.detector + " #" + x.rank + ": story " + x.story + ", query " + x.query +
      ", value " + fmt(x.value);
  }

  /* The shown tokens as items {text, fill, bold}: what the screen and tokensSvg both draw. */
  function tokenItems(x) {
    return x.cells.map(function (c) {
      return { text: c.gap ? c.text : shown(c.text), fill: c.weight !== null ? shade(c.weight) : "#ffffff", bold: c.query };
    });
  }

  /* One example: its rank, story, query, value and most-attended key with export, then its tokens;
   * a click (or Enter) makes it the chosen one. */
  function exampleView(v, r, x, i) {
    var box = el("div", "sle-example");
    box.dataset.rank = String(x.rank);
    box.dataset.value = String(x.value);
    box.dataset.story = String(x.story);
    box.dataset.query = String(x.query);
    box.tabIndex = 0;
    var head = el("div", "sle-example-head");
    head.appendChild(el("span", "sle-rank", "#" + x.rank));
    head.appendChild(el("span", "sle-where", "story " + x.story + ", query " + x.query));
    head.appendChild(el("span", "sle-value", v.state.detector + " " + fmt(x.value)));
    var key = el("span", "sle-key-info", "most attended: ");
    key.appendChild(el("span", "sle-key-tok", shown(x.keyToken)));
    key.appendChild(document.createTextNode(" at " + x.key + ", weight " + fmt(x.keyWeight)));
    head.appendChild(key);
    head.appendChild(X.buttons(function () { return X.tokensSvg(tokenItems(x), { title: exampleTitle(v, r, x), size: TOKEN_FONT }); },
      r.label + "-" + slug(v.state.detector) + "-example-" + x.rank));
    box.appendChild(head);
    box.appendChild(exampleTokens(x));
    function choose(e) {
      if (i === v.state.example || (e.target.closest && e.target.closest(".sl-export"))) { return; }
      v.state.example = i;
      drawDetail(v);
    }
    box.addEventListener("click", choose);
    box.addEventListener("keydown", function (e) { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); choose(e); } });
    return box;
  }

  /* An example's tokens, shaded by weight, the query outlined, the most-attended key underlined. */
  function exampleTokens(x) {
    var line = el("div", "sle-tokens");
    var items = tokenItems(x);
    x.cells.forEach(function (c, j) {
      if (c.gap) {
        var g = el("span", "sle-gap", " " + c.text + " ");
        g.title = "tokens left out between the key's and the query's";
        line.appendChild(g);
        return;
      }
      var s = el("span", "sle-tok", items[j].text);
      s.style.background = items[j].fill;
      s.dataset.pos = String(c.pos);
      if (c.weight !== null) { s.dataset.weight = String(c.weight); s.title = "weight " + fmt(c.weight); }
      else { s.classList.add("sle-after"); }
      if (c.query) { s.classList.add("sle-query"); }
      if (c.key) { s.classList.add("sle-key"); s.title += " (the most attended)"; }
      line.appendChild(s);
    });
    return line;
  }

  /* The bar strip of one example: a column per shown key the query sees (the most-attended
   * among them) and a narrow one for a gap, as {x, w, h, fill, tick, weight, value, query, key, gap}. */
  function stripLayout(x) {
    var left = 8, out = [];
    x.cells.forEach(function (c) {
      if (c.gap) {
        out.push({ x: left, w: 22, h: 0, fill: "#ffffff", tick: GAP, weight: "", value: null, query: false, key: false, gap: true });
        left += 24;
        return;
      }
      if (c.weight === null) { return; }
      var tk = tick(c.text), w = Math.max(34, Math.ceil(X.measure(tk, BAR_FONT)) + 10);
      out.push({ x: left, w: w, h: Math.round(BAR_H * c.weight * 10) / 10, fill: viridis(c.weight),
        tick: tk, weight: c.weight.toFixed(2), value: c.weight, query: c.query, key: c.key, gap: false });
      left += w + 2;
    });
    return { cols: out, width: left + 6 };
  }

  function mapTitle(r, x) {
    return r.label + " on story " + x.story + ", query " + x.query + ": attention over the window" +
      " (most attended: key " + x.key + ", weight " + fmt(x.keyWeight) + ")";
  }

  function stripSvg(r, x) {
    var L = stripLayout(x), top = BAR_FONT * 2 + 18, base = top + BAR_FONT + 4 + BAR_H, body = "";
    body += X.text(8, BAR_FONT + 6, mapTitle(r, x), BAR_FONT + 1, { weight: "bold" });
    L.cols.forEach(function (c) {
      var mid = c.x + c.w / 2;
      if (c.gap) { body += X.text(mid, base - BAR_H / 2, c.tick, BAR_FONT, { anchor: "middle" }); return; }
      body += X.rect(c.x, top + BAR_FONT + 4, c.w, BAR_H, "#f6f8fa");
      body += X.rect(c.x, base - c.h, c.w, c.h, c.fill);
      body += X.text(mid, top + BAR_FONT, c.weight, BAR_FONT, { anchor: "middle" });
      body += X.text(mid, base + BAR_FONT + 4, c.tick, BAR_FONT, { anchor: "middle", weight: c.query || c.key ? "bold" : null });
    });
    return X.doc(Math.max(L.width, X.measure(mapTitle(r, x), BAR_FONT + 1) + 16), base + BAR_FONT + 12, body);
  }

  function mapView(v, r, x) {
    var box = el("div", "sle-map");
    var head = el("div", "sle-map-head");
    head.appendChild(el("span", "sle-map-title", mapTitle(r, x)));
    head.appendChild(X.buttons(function () { return stripSvg(r, x); }, r.label + "-" + slug(v.state.detector) + "-example-" + x.rank + "-map"));
    box.appendChild(head);
    var strip = el("div", "sle-strip");
    stripLayout(x).cols.forEach(function (c) {
      if (c.gap) {
        var gap = el("div", "sle-bar-gap", c.tick);
        gap.style.width = c.w + "px";
        strip.appendChild(gap);
        return;
      }
      var col = el("div", "sle-bar-col" + (c.query ? " sle-query" : "") + (c.key ? " sle-key" : ""));
      col.style.width = c.w + "px";
      col.dataset.weight = String(c.value);
      col.appendChild(el("span", "sle-bar-w", c.weight));
      var well = el("div", "sle-bar-well");
      well.style.height = BAR_H + "px";
      var bar = el("div", "sle-bar");
      bar.style.height = c.h + "px";
      bar.style.background = c.fill;
      well.appendChild(bar);
      col.appendChild(well);
      col.appendChild(el("span", "sle-bar-tok", c.tick));
      strip.appendChild(col);
    });
    box.appendChild(strip);
    return box;
  }


  /* The chosen head: its title, its scores, then (where the run kept examples) the detector's
   * picker and its top examples, the chosen one open on its map. */
  function drawDetail(v) {
    var r = v.state.head, detail = v.ui.detail, ex = v.ex;
    detail.textContent = "";
    if (!r) {
      detail.appendChild(el("p", "sle-hint", "Click a head in the table or the grid to see where it fires."));
      return;
    }
    detail.appendChild(el("h2", "sle-head-title", r.label));
    detail.appendChild(headStats(v, r));
    if (!ex) {
      detail.appendChild(el("p", "sle-hint", "No examples in this run (it was scored with --examples 0)."));
      return;
    }
    var n = ex.heads[r.index].top[v.state.detector].length;
    detail.appendChild(detectorPick(v, r, n));
    v.root.dataset.detector = v.state.detector;
    if (!n) {
      detail.appendChild(el("p", "sle-hint", "No counted query for " + v.state.detector + " in this run."));
      return;
    }
    v.state.example = Math.min(v.state.example, n - 1);
    v.root.dataset.example = String(v.state.example);
    var list = el("div", "sle-examples");
    for (var i = 0; i < n; i++) {
      var x = site(v, r, i), view = exampleView(v, r, x, i);
      if (i === v.state.example) {  // the chosen example opens on its map
        view.classList.add("sle-chosen");
        view.appendChild(mapView(v, r, x));
      }
      list.appendChild(view);
    }
    detail.appendChild(list);
  }

  /* The head's output share and its detectors' scores, and its flags. */
  function headStats(v, r) {
    var stats = el("p", "sle-stats");
    var shownCols = v.ex ? v.ex.detectors.filter(function (d) { return v.cols.indexOf(d) >= 0; }) : [];
    ["output_share"].concat(shownCols).forEach(function (c) {
      if (v.cols.indexOf(c) >= 0) { stats.appendChild(el("span", "sle-stat", c + " " + fmt(r[c]))); }
    });
    if (flagged(r[FLAG])) { stats.appendChild(el("span", "sle-stat sle-flag", "dormant")); }
    return stats;
  }

  /* The detector whose examples are shown, the head's strongest, and how the n examples were chosen. */
  function detectorPick(v, r, n) {
    var ex = v.ex, s = v.state, pick = el("div", "sle-controls");
    pick.appendChild(el("span", "sle-ctl", "detector"));
    var det = el("select", "sle-detector");
    det.setAttribute("aria-label", "the detector whose top examples are shown");
    ex.detectors.forEach(function (d) { var o = el("option", null, d); o.value = d; det.appendChild(o); });
    det.value = s.detector;
    det.addEventListener("change", function () { s.detector = det.value; s.example = 0; drawDetail(v); });
    pick.appendChild(det);
    var own = strongest(v, r);
    if (own !== null) {
      var why = el("span", "sle-ctl sle-strongest", own === s.detector
        ? "(its strongest: " + fmt(r[own]) + ", " + Math.round(100 * r[own] / v.best[own]) + "% of the best head's)"
        : "(its strongest is " + own + ")");
      why.dataset.detector = own;
      pick.appendChild(why);
    }
    pick.appendChild(el("span", "sle-ctl sle-how", n + " of at most " + ex.k + " examples: the queries where " +
      s.detector + " is highest over the corpus" + (ex.perStory ? ", at most " + ex.perStory + " from one story" : "") +
      "; each earlier token shaded by the attention the query (outlined) gives it, the most-attended key" +
      " underlined. Click an example for its map."));
    return pick;
  }

  function select(v, r) {
    if (v.state.head) { v.state.head.tr.classList.remove("sle-selected"); }
    v.cells.forEach(function (x) { x.el.classList.toggle("sle-selected", x.row === r); });
    v.state.head = r;
    v.state.example = 0;
    var own = strongest(v, r);
    if (own !== null) { v.state.detector = own; }
    r.tr.classList.add("sle-selected");
    v.root.dataset.head = r.label;
    drawDetail(v);
  }

  /* The grid's column chosen: its detector (prev_token for norm_prev_token too) becomes the one
   * whose examples are shown, where examples were kept for it. */
  function chooseColumn(v, c) {
    v.state.column = c;
    var d = c.replace(/^norm_/, "");
    if (v.ex && v.ex.detectors.indexOf(d) >= 0) { v.state.detector = d; v.state.example = 0; }
    drawGrid(v);
    drawDetail(v);
  }

  function mount(id) {
    var v = explorerView(document.getElementById(id), JSON.parse(document.getElementById(id + "-data").textContent));
    buildMeta(v);
    buildTable(v);
    buildGrid(v);
    v.ui.detail = el("section", "sle-section sle-detail");
    v.root.appendChild(v.ui.detail);
    applyTable(v);
    chooseColumn(v, v.state.column);
    fromHash(v);
    window.addEventListener("hashchange", function () { fromHash(v); });
    v.root.dataset.ready = "1";
  }

  /* explore.html#L4H2 opens that head's page (why.html's writers and the report's cards link here). */
  function fromHash(v) {
    var want = decodeURIComponent((window.location.hash || "").slice(1));
    var r = v.heads.filter(function (x) { return x.label === want; })[0];
    if (r) { select(v, r); if (v.ui.detail.scrollIntoView) { v.ui.detail.scrollIntoView(); } }
  }

  window.StorylensExplorer = { mount: mount, parseFilter: parseFilter };
})();
