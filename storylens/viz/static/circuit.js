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

  function place(label) {
    var n = node(label), width = D.n_head * (NODE + GAP);
    var x = n[2] === "input" || n[2] === "logits" || /^M/.test(n[2]) ? PAD + width / 2 - NODE / 2 : PAD + n[1] * (NODE + GAP);
    var y = PAD + (2 * D.n_layer + 1 - n[0]) * ROW / 2;
    return [x + NODE / 2, y, n[2]];
  }

  function graphSvg(k) {
    var edges = D.edges.slice(0, k), big = 0, body = "", seen = {};
    edges.forEach(function (e) { big = Math.max(big, Math.abs(e.score)); });
    edges.forEach(function (e) {
      var a = place(e.writer), b = place(e.receiver), kind = e.receiver.split(".")[1] || "";
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
    var width = 2 * PAD + D.n_head * (NODE + GAP), height = 2 * PAD + (2 * D.n_layer + 1) * ROW / 2;
    return X.doc(width, height, body);
  }

  function curveSvg() {
    var f = D.faithfulness, W = 360, H = 240, L = 50, B = 40, body = "";
    var lo = Math.log10(f.percentages[0] || 0.001), hi = 0;
    function x(p) { return L + (W - L - 10) * (Math.log10(Math.max(p, 1e-4)) - lo) / (hi - lo || 1); }
    function y(v) { return H - B - (H - B - 10) * Math.max(-0.2, Math.min(1.2, v)) / 1.2; }
    body += '<line x1="' + L + '" y1="' + y(1) + '" x2="' + (W - 10) + '" y2="' + y(1) + '" stroke="#bbb" stroke-dasharray="4 3"/>';
    body += '<line x1="' + L + '" y1="' + y(0) + '" x2="' + (W - 10) + '" y2="' + y(0) + '" stroke="#888"/>';
    var pts = f.percentages.map(function (p, i) { return x(p) + "," + y(f.f[i]); }).join(" ");
    body += '<polyline points="' + pts + '" fill="none" stroke="#222" stroke-width="2"/>';
    f.percentages.forEach(function (p, i) {
      body += '<line x1="' + x(p) + '" y1="' + y(f.f[i] - 2 * f.f_se[i]) + '" x2="' + x(p) + '" y2="' + y(f.f[i] + 2 * f.f_se[i]) + '" stroke="#222"/>';
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
      rows.push("<tr><td>" + X.esc(e.writer) + "</td><td>" + X.esc(e.receiver) + "</td><td>" + e.score.toFixed(3) +
        "</td><td>" + e.score_se.toFixed(3) + "</td></tr>");
    });
    t.innerHTML = rows.join("");
  }

  var picked = null;

  function mapSpec(side) {  /* the picked head's attention on the chosen pair, one side */
    var p = D.pairs[+document.getElementById("slc-pair").value][side];
    return X.attentionSpec(p, picked[0], picked[1], "L" + (picked[0] + 1) + "H" + (picked[1] + 1) + " on the " + side + " text");
  }

  function drawMaps() {
    var maps = document.getElementById("slc-maps");
    maps.innerHTML = "";
    if (picked === null || !D.pairs.length) { return; }
    ["clean", "corrupt"].forEach(function (side) {
      var box = X.pictureBox(function () { return X.gridSvg(mapSpec(side)); }, "attention-" + side);
      box.setAttribute("data-side", side);
      maps.appendChild(box);
    });
  }

  function pick(name) {
    var m = /^L(\d+)H(\d+)$/.exec(name);
    picked = [(+m[1]) - 1, (+m[2]) - 1];
    document.getElementById("slc-head").textContent = name + ": its attention on the pair, clean and corrupt";
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
    o.textContent = "line " + p.line;
    select.appendChild(o);
  });
  select.addEventListener("change", drawMaps);

  var slider = document.getElementById("slc-size");
  slider.max = String(D.edges.length);
  slider.value = String(Math.min(D.edges.length, D.circuit_size ? Math.max(1, D.circuit_size) : 20));
  slider.addEventListener("input", function () { show(+slider.value); });
  var c = document.getElementById("slc-curve");
  c.innerHTML = curveSvg();
  c.appendChild(X.buttons(curveSvg, "faithfulness"));
  var f = D.faithfulness;
  document.getElementById("slc-summary").textContent = "CPR " + f.cpr.toFixed(3) + " ± " + f.cpr_se.toFixed(3) +
    ", CMD " + f.cmd.toFixed(3) + " ± " + f.cmd_se.toFixed(3) + "; clean " + f.clean.toFixed(3) + ", corrupt " + f.corrupt.toFixed(3) +
    (D.circuit_size ? "; the smallest circuit keeping 80% holds the top " + D.circuit_size + " edges" : "");
  show(+slider.value);
})();
