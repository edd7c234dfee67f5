/* storylens export: take a view away as SVG or PNG, offline.
 *
 * Shared by the widget, the report and the explorer (inlined once per page; a second copy
 * returns at once). Every picture is first an SVG string drawn from the view's own data, with
 * the colours and labels shown on screen; PNG is that SVG rasterised on a canvas. Downloads are
 * data: URLs, so nothing is fetched. inflate() unpacks the zlib-deflated binary that storylens
 * embeds (attention maps, figure SVGs) with the browser's own DecompressionStream.
 */
(function () {
  "use strict";
  if (window.StorylensExport) { return; }
  var FONT = "sans-serif";

  function esc(s) {
    return String(s).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;").replace(/"/g, "&quot;");
  }

  function num(x) { return String(Math.round(x * 100) / 100); }

  function doc(width, height, body) {
    return '<svg xmlns="http://www.w3.org/2000/svg" width="' + Math.ceil(width) + '" height="' + Math.ceil(height) +
      '" viewBox="0 0 ' + Math.ceil(width) + " " + Math.ceil(height) + '" font-family="' + FONT + '">' +
      '<rect width="100%" height="100%" fill="#fff"/><g shape-rendering="crispEdges">' + body + "</g></svg>";
  }

  function rect(x, y, w, h, fill, extra) {
    return '<rect x="' + num(x) + '" y="' + num(y) + '" width="' + num(w) + '" height="' + num(h) +
      '" fill="' + esc(fill) + '"' + (extra || "") + "/>";
  }

  function text(x, y, s, size, opts) {
    opts = opts || {};
    var a = ' font-size="' + size + '"';
    if (opts.anchor) { a += ' text-anchor="' + opts.anchor + '"'; }
    if (opts.fill) { a += ' fill="' + esc(opts.fill) + '"'; }
    if (opts.weight) { a += ' font-weight="' + opts.weight + '"'; }
    if (opts.rotate) { a += ' transform="rotate(' + opts.rotate + " " + num(x) + " " + num(y) + ')"'; }
    if (opts.baseline) { a += ' dominant-baseline="' + opts.baseline + '"'; }
    return '<text x="' + num(x) + '" y="' + num(y) + '"' + a + ">" + esc(s) + "</text>";
  }

  var measurer = null;
  function measure(s, size) {
    if (!measurer) { measurer = document.createElement("canvas").getContext("2d"); }
    measurer.font = size + "px " + FONT;
    return measurer.measureText(String(s)).width;
  }

  /* A grid of coloured cells: spec = {rows, cols, fill(r, c), label(r, c) (optional cell text),
   * ink(r, c) (its colour), rowLabels, colLabels, title, cell: [w, h], size (font px)}. */
  function gridSvg(spec) {
    var size = spec.size || 12, cw = spec.cell[0], ch = spec.cell[1];
    var rowLabels = spec.rowLabels || [], colLabels = spec.colLabels || [];
    var left = 8 + Math.max(0, Math.max.apply(null, rowLabels.map(function (l) { return measure(l, size); }).concat([0])));
    var colW = Math.max(0, Math.max.apply(null, colLabels.map(function (l) { return measure(l, size); }).concat([0])));
    var rotate = colW > cw - 2;
    var top = (spec.title ? size + 10 : 4) + (colLabels.length ? (rotate ? colW + 6 : size + 6) : 0);
    var body = spec.title ? text(4, size + 2, spec.title, size + 1, { weight: "bold" }) : "";
    for (var c = 0; c < colLabels.length; c++) {
      var cx = left + c * cw + cw / 2;
      body += rotate
        ? text(cx + size / 3, top - 4, colLabels[c], size, { anchor: "start", rotate: -90 })
        : text(cx, top - 5, colLabels[c], size, { anchor: "middle" });
    }
    for (var r = 0; r < spec.rows; r++) {
      if (rowLabels[r] !== undefined) {
        body += text(left - 5, top + r * ch + ch / 2, rowLabels[r], size, { anchor: "end", baseline: "central" });
      }
      for (c = 0; c < spec.cols; c++) {
        body += rect(left + c * cw, top + r * ch, cw, ch, spec.fill(r, c));
        var lab = spec.label ? spec.label(r, c) : "";
        if (lab) {
          body += text(left + c * cw + cw / 2, top + r * ch + ch / 2, lab, size,
            { anchor: "middle", baseline: "central", fill: spec.ink ? spec.ink(r, c) : "#000" });
        }
      }
    }
    var titleW = spec.title ? measure(spec.title, size + 1) + 12 : 0;  // a long title widens the picture
    return doc(Math.max(left + spec.cols * cw + 8, titleW), top + spec.rows * ch + 8, body);
  }

  /* Tokens set as running text with a background per token: items = [{text, fill, bold}]. */
  function tokensSvg(items, opts) {
    opts = opts || {};
    var size = opts.size || 14, width = opts.width || 760, lineH = Math.round(size * 1.7), pad = 3;
    var x = 6, y = opts.title ? size * 2 + 6 : 6, body = "";
    if (opts.title) { body += text(6, size + 4, opts.title, size, { weight: "bold" }); }
    items.forEach(function (it) {
      var s = it.text, w = measure(s, size) + 2 * pad;
      if (x + w > width - 6 && x > 6) { x = 6; y += lineH; }
      body += rect(x, y, w, lineH - 4, it.fill || "#fff", it.bold ? ' stroke="#333" stroke-width="1.5"' : "");
      body += text(x + pad, y + (lineH - 4) / 2, s, size, { baseline: "central", weight: it.bold ? "bold" : null });
      x += w + 1;
    });
    return doc(width, y + lineH + 6, body);
  }

  function download(href, name) {
    var a = document.createElement("a");
    a.href = href;
    a.download = name;
    a.style.display = "none";
    document.body.appendChild(a);
    a.click();
    setTimeout(function () { a.remove(); }, 0);
  }

  function svgUrl(svg) { return "data:image/svg+xml;charset=utf-8," + encodeURIComponent(svg); }

  function saveSvg(svg, name) { download(svgUrl(svg), name + ".svg"); }

  /* The SVG drawn on a canvas at `scale` (2: sharp on slides), saved as PNG. */
  function savePng(svg, name, scale) {
    scale = scale || 2;
    var img = new Image();
    img.onload = function () {
      var c = document.createElement("canvas");
      c.width = Math.ceil(img.naturalWidth * scale);
      c.height = Math.ceil(img.naturalHeight * scale);
      var ctx = c.getContext("2d");
      ctx.fillStyle = "#fff";
      ctx.fillRect(0, 0, c.width, c.height);
      ctx.drawImage(img, 0, 0, c.width, c.height);
      download(c.toDataURL("image/png"), name + ".png");
    };
    img.src = svgUrl(svg);
  }

  /* Two buttons, "PNG" and "SVG", that save what makeSvg() draws (called at click time). */
  function buttons(makeSvg, name) {
    var box = document.createElement("span");
    box.className = "sl-export";
    [["PNG", "sl-export-png"], ["SVG", "sl-export-svg"]].forEach(function (p) {
      var b = document.createElement("button");
      b.type = "button";
      b.className = p[1];
      b.textContent = p[0];
      b.title = "Save this view as " + p[0];
      b.addEventListener("click", function () {
        var svg = makeSvg();
        var n = typeof name === "function" ? name() : name;
        if (p[0] === "SVG") { saveSvg(svg, n); } else { savePng(svg, n, 2); }
      });
      box.appendChild(b);
    });
    return box;
  }

  function bytes(b64) {
    var s = atob(b64), out = new Uint8Array(s.length);
    for (var i = 0; i < s.length; i++) { out[i] = s.charCodeAt(i); }
    return out;
  }

  /* base64 of zlib-deflated bytes -> Promise of the bytes (an ArrayBuffer). */
  function inflate(b64) {
    if (typeof DecompressionStream === "undefined") {
      return Promise.reject(new Error("this browser has no DecompressionStream (needs Chrome 80, Firefox 113, Safari 16.4 or later)"));
    }
    var stream = new Blob([bytes(b64)]).stream().pipeThrough(new DecompressionStream("deflate"));
    return new Response(stream).arrayBuffer();
  }

  /* A gridSvg spec of one head's attention on one side of a pair: `side` {tokens, attention[layer][head][q][k]}. */
  function attentionSpec(side, layer, head, title) {
    var a = side.attention[layer][head], T = side.tokens.length;
    return {
      title: title, rows: T, cols: T, cell: [18, 18], rowLabels: side.tokens, colLabels: side.tokens, size: 10,
      fill: function (r, c) {
        var v = c <= r ? a[r][c] : 0, g = Math.round(255 * (1 - v));
        return "rgb(" + g + "," + g + ",255)";
      }
    };
  }

  /* A box holding the picture makeSvg() draws, under its PNG and SVG buttons. */
  function pictureBox(makeSvg, name) {
    var box = document.createElement("div");
    box.appendChild(buttons(makeSvg, name));
    var pic = document.createElement("div");
    pic.innerHTML = makeSvg();
    box.appendChild(pic);
    return box;
  }

  window.StorylensExport = {
    esc: esc, doc: doc, rect: rect, text: text, measure: measure, gridSvg: gridSvg, tokensSvg: tokensSvg,
    download: download, saveSvg: saveSvg, savePng: savePng, buttons: buttons, bytes: bytes, inflate: inflate,
    attentionSpec: attentionSpec, pictureBox: pictureBox
  };
})();
