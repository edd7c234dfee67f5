/* storylens circuit.html: the layered graph of the top edges, a size slider, the faithfulness curve, a table. */
(function () {
  "use strict";
  var X = window.StorylensExport;
  var D = JSON.parse(document.getElementById("slc-data").textContent);
  var NODE = 46, GAP = 14, ROW = 70, PAD = 30;

  function node(label) {  /* writer or receiver label -> [row, column, name] */
    if (label === "input") { return [0, 0, "input"]; }
    if (label === "logits") { return [2 * D.n_layer + 1, 0, "logits"]; }
    var base = label.split(".")[0], m = /^M(\d+)$/.exec(base);
    if (m) { return [2 * (+m[1]), 0, base]; }
    m = /^L(\d+)H(\d+)$/.exec(base);
    if (m) { return [2 * (+m[1]) - 1, (+m[2]) - 1, base]; }
    m = /^L(\d+)KV(\d+)$/.exec(base);  /* a key/value group: drawn at its first query head */
    var group = D.n_head / D.n_kv_head;
    return [2 * (+m[1]) - 1, ((+m[2]) - 1) * group, base];
  }

  function place(label, rank, rows) {  /* rank: the node's row among the rows drawn (only those with a node) */
    var n = node(label), width = D.n_head * (NODE + GAP);
    var x = n[2] === "input" || n[2] === "logits" || /^M/.test(n[2]) ? PAD + width / 2 - NODE / 2 : PAD + n[1] * (NODE + GAP);
    var y = PAD + (rows - 1 - rank[n[0]]) * ROW * 0.6;
    return [x + NODE / 2, y, n[2]];
  }

  function graphSvg(k) {
    var edges = D.edges.slice(0, k), big = 0, body = "", seen = {}, used = {};
    edges.forEach(function (e) {
      big = Math.max(big, Math.abs(e.score));
      used[node(e.writer)[0]] = true;
      used[node(e.receiver)[0]] = true;
    });
    var order = Object.keys(used).map(Number).sort(function (a, b) { return a - b; }), rank = {};
    order.forEach(function (r, i) { rank[r] = i; });  /* rows (blocks' heads, their MLPs) with no node are left out */
    edges.forEach(function (e) {
      var a = place(e.writer, rank, order.length), b = place(e.receiver, rank, order.length), kind = e.receiver.split(".")[1] || "";
      var dash = kind === "k" ? ' stroke-dasharray="6 3"' : kind === "v" ? ' stroke-dasharray="2 3"' : "";
      var w = 0.5 + 5 * Math.abs(e.score) / (big || 1), col = e.score > 0 ? "#c0392b" : "#2c6fbb";
      body += '<line x1="' + a[0] + '" y1="' + (a[1] - 9) + '" x2="' + b[0] + '" y2="' + (b[1] + 9) + '" stroke="' + col +
        '" stroke-width="' + w.toFixed(2) + '" stroke-opacity="0.75"' + dash + '/>';
      seen[a[2]] = a; seen[b[2]] = b;
    });
    Object.keys(seen).forEach(function (name) {
      var p = seen[name], head = /^L\d+H\d+$/.test(name);
      body += (head ? '<g class="head" data-head="' + X.esc(name) + '">' : "") +
        X.rect(p[0] - NODE / 2, p[1] - 9, NODE, 18, head ? "#eef3fb" : "#f4f4f4", ' stroke="#888"') +
        X.text(p[0], p[1] + 4, name, 11, { anchor: "middle" }) + (head ? "</g>" : "");
    });
    var width = 2 * PAD + D.n_head * (NODE + GAP), height = 2 * PAD + Math.max(0, order.length - 1) * ROW * 0.6;
    return X.doc(width, height, body);
  }

  function curveSvg() {
    var f = D.faithfulness, W = 360, H = 240, L = 50, B = 40, body = "";
    var lo = Math.log10(f.percentages[0] || 0.001), hi = 0;
    function x(p) { return L + (W - L - 10) * (Math.log10(Math.max(p, 1e-4)) - lo) / (hi - lo || 1); }
    function y(v) { return H - B - (H - B - 10) * (Math.max(-0.2, Math.min(1.2, v)) + 0.2) / 1.4; }  /* -0.2 .. 1.2, bars clipped */
    body += '<line x1="' + L + '" y1="' + y(1) + '" x2="' + (W - 10) + '" y2="' + y(1) + '" stroke="#bbb" stroke-dasharray="4 3"/>';
    body += '<line x1="' + L + '" y1="' + y(0) + '" x2="' + (W - 10) + '" y2="' + y(0) + '" stroke="#888"/>';
    var pts = f.percentages.map(function (p, i) { return x(p) + "," + y(f.f[i]); }).join(" ");
    body += '<polyline points="' + pts + '" fill="none" stroke="#222" stroke-width="2"/>';
    f.percentages.forEach(function (p, i) {
      if (f.f_se[i] !== null) {  /* null: one pair or story, no error to draw */
        body += '<line x1="' + x(p) + '" y1="' + y(f.f[i] - 2 * f.f_se[i]) + '" x2="' + x(p) + '" y2="' + y(f.f[i] + 2 * f.f_se[i]) + '" stroke="#222"/>';
      }
      body += X.text(x(p), H - B + 14, (100 * p) + "%", 9, { anchor: "middle" });
    });
    body += X.text(L - 6, y(1) + 4, "1", 10, { anchor: "end" }) + X.text(L - 6, y(0) + 4, "0", 10, { anchor: "end" });
    body += X.text((W + L) / 2, H - 6, "edges in the circuit (share of all, log scale)", 11, { anchor: "middle" });
    body += X.text(14, (H - B) / 2, "faithfulness", 11, { anchor: "middle", rotate: -90 });
    return X.doc(W, H, body);
  }

  function table(k) {
    var t = document.getElementById("slc-table"), rows = ["<tr><th>writer</th><th>receiver</th><th>score</th><th>±</th></tr>"];
    D.edges.slice(0, k).forEach(function (e) {
      rows.push("<tr><td>" + X.esc(e.writer) + "</td><td>" + X.esc(e.receiver) + "</td><td>" + num(e.score) +
        "</td><td>" + num(e.score_se) + "</td></tr>");
    });
    t.innerHTML = rows.join("");
  }

  var picked = null;
  var MOST_AT_FIRST = 60;  /* the edges drawn before the slider moves: more is a thicket on a many-head model */

  function num(x) {  /* three decimals, or three significant digits for the small scores a loss gives; null: none */
    if (x === null) { return "n/a"; }
    return Math.abs(x) >= 0.1 || x === 0 ? x.toFixed(3) : x.toPrecision(3);
  }

  function pm(se) {  /* an error that could not be estimated (one pair or story) is null: said, never shown as 0 */
    return se === null ? " (no error)" : " ± " + se.toFixed(3);
  }

  function mapSpec(side) {  /* the picked head's attention on the chosen pair, one side */
    var p = D.pairs[+document.getElementById("slc-pair").value][side];
    return X.attentionSpec(p, picked[0], picked[1], "L" + (picked[0] + 1) + "H" + (picked[1] + 1) + " on the " + side + " text");
  }

  function drawMaps() {
    var maps = document.getElementById("slc-maps");
    maps.innerHTML = "";
    if (picked === null || !D.pairs.length) { return; }
    var p = D.pairs[+document.getElementById("slc-pair").value];
    ["clean", "corrupt"].filter(function (side) { return p[side]; }).forEach(function (side) {
      var box = X.pictureBox(function () { return X.gridSvg(mapSpec(side)); }, "attention-" + side);
      box.setAttribute("data-side", side);
      maps.appendChild(box);
    });
  }

  function pick(name) {
    var m = /^L(\d+)H(\d+)$/.exec(name);
    picked = [(+m[1]) - 1, (+m[2]) - 1];
    document.getElementById("slc-head").textContent = name + (D.task === "stories" ? ": its attention on the story's first tokens" : ": its attention on the pair, clean and corrupt");
    drawMaps();
  }

  function show(k) {
    document.getElementById("slc-size-label").textContent = k + " of " + D.n_edges + " edges (the top by |score|)";
    var g = document.getElementById("slc-graph");
    g.innerHTML = graphSvg(k);
    g.appendChild(X.buttons(function () { return graphSvg(k); }, "circuit-" + k));
    g.querySelectorAll("g.head").forEach(function (el) {
      el.addEventListener("click", function () { pick(el.getAttribute("data-head")); });
    });
    table(k);
  }

  var select = document.getElementById("slc-pair");
  D.pairs.forEach(function (p, i) {
    var o = document.createElement("option");
    o.value = String(i);
    o.textContent = (D.task === "stories" ? "story " : "line ") + p.line;
    select.appendChild(o);
  });
  select.addEventListener("change", drawMaps);

  var slider = document.getElementById("slc-size");
  slider.max = String(D.edges.length);
  var inCircuit = D.edges.filter(function (e) { return e.in_circuit; }).length;  /* the smallest faithful one, drawn */
  slider.value = String(Math.min(D.edges.length, MOST_AT_FIRST, inCircuit || 20));
  slider.addEventListener("input", function () { show(+slider.value); });
  var c = document.getElementById("slc-curve");
  c.innerHTML = curveSvg();
  c.appendChild(X.buttons(curveSvg, "faithfulness"));
  var f = D.faithfulness;
  document.getElementById("slc-summary").textContent = "CPR " + f.cpr.toFixed(3) + pm(f.cpr_se) +
    ", CMD " + f.cmd.toFixed(3) + pm(f.cmd_se) + "; clean " + f.clean.toFixed(3) + (D.task === "stories" ? ", every edge ablated " : ", corrupt ") + f.corrupt.toFixed(3) +
    (D.circuit_size ? "; the smallest circuit keeping 80% holds the top " + D.circuit_size + " edges" : "");
  show(+slider.value);
})();
