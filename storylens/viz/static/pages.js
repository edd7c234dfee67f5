/* storylens pages (the report): the overview of every head, and PNG/SVG buttons on every figure.
 *
 * - A <select class="sl-ov-pick"> shows one of the overview's grids (.sl-ov[data-col]); a click on a
 *   head's cell (td[data-head]) shows that head in the page's attention widget, block and head
 *   selected, as maps of its block.
 * - Every figure with an image gets "PNG" (the embedded image itself) and "SVG" (the figure's own
 *   SVG, embedded deflated in data-svg: matplotlib's, text kept as text) buttons; every heatmap
 *   table (table.slh) gets both, drawn from its own cells, colours and labels.
 * Needs StorylensExport (export.js, inlined before this script).
 */
(function () {
  "use strict";
  var X = window.StorylensExport;

  function tableSvg(table) {
    var rows = Array.prototype.slice.call(table.querySelectorAll("tr"));
    var colLabels = Array.prototype.map.call(rows[0].querySelectorAll("th"), function (th) { return th.textContent; }).slice(1);
    var body = rows.slice(1);
    var cells = body.map(function (tr) { return Array.prototype.slice.call(tr.querySelectorAll("td")); });
    var cap = table.querySelector("caption");
    return X.gridSvg({
      rows: body.length, cols: colLabels.length, cell: [50, 24], size: 12,
      title: cap ? cap.textContent : "",
      rowLabels: body.map(function (tr) { return tr.querySelector("th").textContent; }),
      colLabels: colLabels,
      fill: function (r, c) { return getComputedStyle(cells[r][c]).backgroundColor; },
      ink: function (r, c) { return getComputedStyle(cells[r][c]).color; },
      label: function (r, c) { return cells[r][c].textContent; }
    });
  }

  function slug(s) { return String(s).toLowerCase().replace(/[^a-z0-9]+/g, "-").replace(/^-|-$/g, "").slice(0, 60) || "figure"; }

  function addFigureButtons() {
    document.querySelectorAll("figure").forEach(function (fig) {
      if (fig.querySelector(".sl-export")) { return; }
      var img = fig.querySelector(":scope > img"), table = fig.querySelector("table.slh");
      var cap = fig.querySelector("figcaption");
      var name = fig.getAttribute("data-name") || slug(cap ? cap.textContent : "figure");
      var box;
      if (table) {
        box = X.buttons(function () { return tableSvg(table); }, name);
      } else if (img && fig.hasAttribute("data-svg")) {
        box = document.createElement("span");
        box.className = "sl-export";
        var png = document.createElement("button"), svg = document.createElement("button");
        png.type = svg.type = "button";
        png.className = "sl-export-png"; svg.className = "sl-export-svg";
        png.textContent = "PNG"; svg.textContent = "SVG";
        png.addEventListener("click", function () { X.download(img.src, name + ".png"); });
        svg.addEventListener("click", function () {
          X.inflate(fig.getAttribute("data-svg")).then(function (buf) {
            X.saveSvg(new TextDecoder().decode(buf), name);
          });
        });
        box.appendChild(png); box.appendChild(svg);
      } else {
        return;
      }
      fig.insertBefore(box, fig.firstChild);
    });
  }

  function showHead(label) {
    var m = /^L(\d+)H(\d+)$/.exec(label), root = document.querySelector(".slw-root.slw-attention");
    if (!m || !root) { return; }
    var selB = root.querySelector(".slw-block"), selH = root.querySelector(".slw-head");
    selB.value = String(+m[1] - 1); selB.dispatchEvent(new Event("change"));
    selH.value = String(+m[2] - 1); selH.dispatchEvent(new Event("change"));
    var maps = root.querySelector(".slw-mode-maps");
    if (maps && root.getAttribute("data-mode") !== "one") { maps.click(); }
    root.scrollIntoView({ block: "start" });
    var out = document.querySelector(".sl-ov-picked");
    if (out) { out.textContent = label + " is shown in the widget below."; }
  }

  function overview() {
    var pick = document.querySelector(".sl-ov-pick");
    if (!pick) { return; }
    var show = function () {
      document.querySelectorAll(".sl-ov").forEach(function (d) { d.hidden = d.getAttribute("data-col") !== pick.value; });
    };
    pick.addEventListener("change", show);
    show();
    document.querySelectorAll(".sl-ov td[data-head]").forEach(function (td) {
      td.style.cursor = "pointer";
      td.addEventListener("click", function () { showHead(td.getAttribute("data-head")); });
    });
  }

  function go() { addFigureButtons(); overview(); document.body.setAttribute("data-sl-ready", "1"); }
  if (document.readyState === "loading") { document.addEventListener("DOMContentLoaded", go); } else { go(); }
})();
