/* storylens patch page: the block x head grids of patching effects (exact, atp) and, for the
 * head clicked, its attention on a pair (clean and corrupt). Data: #slp-data (see viz/patch.py). */
(function () {
  "use strict";
  var X = window.StorylensExport;
  var data = JSON.parse(document.getElementById("slp-data").textContent);
  var R = data.result, pairs = data.pairs;
  var L = R.n_layer, H = R.n_head, picked = null;
  var byCell = {};
  R.heads.forEach(function (h) { byCell[h.layer + "," + h.index] = h; });
  var scale = 1e-12;
  R.heads.forEach(function (h) {
    scale = Math.max(scale, Math.abs(h.atp), h.exact === null ? 0 : Math.abs(h.exact));
  });

  function fmt(x) { return x === null ? "n/a" : (x >= 0 ? "+" : "") + x.toFixed(3); }

  function colour(v) {  /* blue (lowers) - white - red (raises), on the largest |effect| */
    if (v === null) { return "#ddd"; }
    var t = Math.max(-1, Math.min(1, v / scale)), a = Math.round(255 * (1 - Math.abs(t)));
    return t >= 0 ? "rgb(255," + a + "," + a + ")" : "rgb(" + a + "," + a + ",255)";
  }

  function pm(se) {  // an error that could not be estimated (one pair) is null: said, never shown as 0
    return se === null || se === undefined ? " (no error: one pair)" : " ± " + se.toFixed(3);
  }

  function gridSpec(key) {
    var rows = [], cols = [];
    for (var l = 0; l < L; l++) { rows.push("L" + (l + 1)); }
    for (var h = 0; h < H; h++) { cols.push("H" + (h + 1)); }
    return {
      title: key, rows: L, cols: H, cell: [44, 26], rowLabels: rows, colLabels: cols, size: 11,
      fill: function (r, c) { return colour(byCell[r + "," + c][key]); },
      label: function (r, c) {  // in parentheses: within two standard errors of zero or no error, no sign claimed
        var h = byCell[r + "," + c], v = h[key], se = h[key + "_se"];
        if (v === null) { return ""; }
        return se === null || se === undefined || Math.abs(v) <= 2 * se ? "(" + v.toFixed(2) + ")" : v.toFixed(2);
      }
    };
  }

  function drawGrid(key) {
    var box = document.createElement("div");
    box.className = "slp-grid";
    box.setAttribute("data-key", key);
    var svg = X.gridSvg(gridSpec(key));
    box.innerHTML = svg;
    var rects = box.querySelectorAll("svg g rect");
    var i = 0;
    for (var r = 0; r < L; r++) {
      for (var c = 0; c < H; c++) {
        var el = rects[i++];
        el.setAttribute("class", "cell");
        el.setAttribute("data-head", "L" + (r + 1) + "H" + (c + 1));
        el.addEventListener("click", pick.bind(null, r, c));
        var h = byCell[r + "," + c];
        var t = document.createElementNS("http://www.w3.org/2000/svg", "title");
        t.textContent = h.head + ": exact " + fmt(h.exact) + ", atp " + fmt(h.atp) + pm(h.atp_se);
        el.appendChild(t);
      }
    }
    var head = document.createElement("div");
    head.appendChild(X.buttons(function () { return X.gridSvg(gridSpec(key)); }, "patch-" + key));
    box.insertBefore(head, box.firstChild);
    return box;
  }

  function mapSpec(side) {
    var p = pairs[+document.getElementById("slp-pair").value][side];
    return X.attentionSpec(p, picked[0], picked[1], byCell[picked[0] + "," + picked[1]].head + " on the " + side + " text");
  }

  function drawMaps() {
    var maps = document.getElementById("slp-maps");
    maps.innerHTML = "";
    if (picked === null || !pairs.length) { return; }
    ["clean", "corrupt"].forEach(function (side) {
      var box = X.pictureBox(function () { return X.gridSvg(mapSpec(side)); }, "attention-" + side);
      box.className = "slp-map";
      box.setAttribute("data-side", side);
      maps.appendChild(box);
    });
  }

  function pick(r, c) {
    picked = [r, c];
    var h = byCell[r + "," + c];
    document.getElementById("slp-head").textContent = h.head + ": exact " + fmt(h.exact) +
      (h.exact === null ? "" : pm(h.exact_se)) + ", atp " + fmt(h.atp) + pm(h.atp_se) + (h.gap_fraction === null ? "" : ", " + h.gap_fraction.toFixed(2) + " of the gap");
    document.querySelectorAll(".slp-grid rect.cell").forEach(function (el) {
      el.classList.toggle("picked", el.getAttribute("data-head") === h.head);
    });
    drawMaps();
  }

  document.getElementById("slp-metric").textContent = R.metric;
  document.getElementById("slp-metrics").textContent = R.pairs + " pairs. clean " + fmt(R.clean_metric) +
    pm(R.clean_metric_se) + "; corrupt " + fmt(R.corrupt_metric) + pm(R.corrupt_metric_se) +
    "; exact on " + R.exact_heads + " of " + R.heads.length + " heads" +
    (R.spearman === null ? "" : "; Spearman rho (atp vs exact) " + R.spearman.toFixed(3));
  var sel = document.getElementById("slp-pair");
  pairs.forEach(function (p, i) {
    var o = document.createElement("option");
    o.value = String(i);
    o.textContent = "line " + p.line + ": " + p.clean.tokens.slice(1).join("");
    sel.appendChild(o);
  });
  sel.addEventListener("change", drawMaps);
  var grids = document.getElementById("slp-grids");
  grids.appendChild(drawGrid("exact"));
  grids.appendChild(drawGrid("atp"));
})();
