// probehook's per-token view. The page is drawn by Python (tokens already coloured by the
// first score); this script adds the score selector, the panel of the token under the pointer
// and the live painting of a streamed reply. No framework, no network.
(function () {
  "use strict";

  // The same colour rule as probehook/viewer/page.py: t in [-1, 1], white to blue above 0,
  // white to red below.
  function shade(t) {
    var c = t < 0 ? [178, 24, 43] : [33, 102, 172], a = Math.abs(t);
    return "rgb(" + c.map(function (x) { return Math.floor(255 + (x - 255) * a + 0.5); })
      .join(", ") + ")";
  }

  function finite(v) { return v !== null && v !== undefined && isFinite(v); }

  // A score's level: a probability as it is, a log-prob's probability, an activation or a
  // value over the series' largest magnitude (negative: below 0).
  function level(value, scale, top) {
    if (!finite(value)) { return null; }
    var t = scale === "logprob" ? Math.exp(value)
      : scale === "probability" ? value : (top > 0 ? value / top : 0);
    return Math.min(1, Math.max(-1, t));
  }

  function seriesTop(series) {
    var top = 0;
    series.values.forEach(function (v) { if (finite(v) && Math.abs(v) > top) { top = Math.abs(v); } });
    return top;
  }

  // A probe's "score": probabilities where every value lies in [0, 1] (a binary or
  // multi-class probe), else values (a regression probe), as page.py's series_scale.
  function scaleOf(series) {
    if (series.scale !== "score") { return series.scale; }
    var inside = series.values.every(function (v) { return !finite(v) || (v >= 0 && v <= 1); });
    return inside ? "probability" : "value";
  }

  function colour(span, series, position) {
    var t = series ? level(series.values[position], scaleOf(series), seriesTop(series)) : null;
    span.style.backgroundColor = t === null ? "" : shade(t);
    span.style.color = t !== null && Math.abs(t) > 0.6 ? "#ffffff" : "";  // page.py's DARK
  }

  // A served column as nested lists: JSON lists as they are, a base64 array (probehook's
  // compact form, `--sae-encoding base64`: {dtype, shape, data}) decoded.
  function columns(value) {
    if (!value || Array.isArray(value) || typeof value.data !== "string") { return value; }
    var bin = atob(value.data), bytes = new Uint8Array(bin.length), flat = [], i;
    for (i = 0; i < bin.length; i++) { bytes[i] = bin.charCodeAt(i); }
    var view = new DataView(bytes.buffer), size = { int32: 4, float32: 4, int64: 8,
      float64: 8, bfloat16: 2, float16: 2 }[value.dtype];
    if (!size) { throw new Error("unknown array dtype " + value.dtype); }
    for (i = 0; i < bytes.length; i += size) {
      flat.push(value.dtype === "int32" ? view.getInt32(i, true)
        : value.dtype === "float32" ? view.getFloat32(i, true)
        : value.dtype === "int64" ? Number(view.getBigInt64(i, true))
        : value.dtype === "float64" ? view.getFloat64(i, true)
        : value.dtype === "bfloat16" ? bfloat16(view.getUint16(i, true))
        : float16(view.getUint16(i, true)));
    }
    function nest(at, dims) {
      if (dims.length <= 1) { return flat.slice(at, at + (dims.length ? dims[0] : 1)); }
      var inner = dims.slice(1).reduce(function (a, b) { return a * b; }, 1), out = [];
      for (var j = 0; j < dims[0]; j++) { out.push(nest(at + j * inner, dims.slice(1))); }
      return out;
    }
    return value.shape.length ? nest(0, value.shape) : flat[0];
  }

  function bfloat16(bits) {
    var v = new DataView(new ArrayBuffer(4));
    v.setUint32(0, bits << 16);
    return v.getFloat32(0);
  }

  function float16(bits) {
    var e = (bits >> 10) & 31, m = bits & 1023, sign = bits >> 15 ? -1 : 1;
    if (e === 31) { return m ? NaN : sign * Infinity; }
    return sign * (e ? Math.pow(2, e - 15) * (1 + m / 1024) : Math.pow(2, -14) * (m / 1024));
  }

  function fmt(x) { return x === null || x === undefined ? "-" : Number(x).toFixed(4); }

  function row(table, cells) {
    var tr = document.createElement("tr");
    cells.forEach(function (text) {
      var td = document.createElement("td");
      td.textContent = text;
      tr.appendChild(td);
    });
    table.appendChild(tr);
  }

  function describe(panel, data, p) {
    panel.textContent = "";
    var head = document.createElement("div");
    var phase = p < data.n_prompt ? "prompt" : "output";
    head.textContent = "token " + JSON.stringify(data.tokens[p]) + " (id " + data.ids[p] +
      ", position " + p + ", " + phase + ")";
    head.className = "ph-panel-head";
    panel.appendChild(head);
    var table = document.createElement("table");
    table.className = "ph-scores";
    data.series.forEach(function (s) { row(table, [s.name, fmt(s.values[p])]); });
    Object.keys(data.marks.flags).forEach(function (key) {
      if (data.marks.flags[key].indexOf(p) >= 0) { row(table, ["flagged", key]); }
    });
    if (data.marks.stop && data.marks.stop.position === p) {
      row(table, ["stopped", data.marks.stop.reason]);
    }
    var steered = data.marks.steered;
    if (steered && p >= steered.from) {
      var ops = steered.ops || {};  // a vector's op where it is not add
      row(table, ["steered", Object.keys(steered.vectors).map(function (name) {
        return name + (ops[name] ? " " + ops[name] : "") + " x" + steered.vectors[name];
      }).join(", ")]);
    }
    Object.keys(data.marks.writes || {}).forEach(function (option) {
      row(table, [option, data.marks.writes[option]]);
    });
    panel.appendChild(table);
    data.top_k.forEach(function (entry) {
      var rows = entry.rows[p];
      if (!rows) { return; }
      var block = document.createElement("div");
      block.className = "ph-top-k";
      block.setAttribute("data-name", entry.name);
      block.textContent = entry.name + ": " + rows.map(function (pair) {
        var label = entry.tokens ? JSON.stringify(entry.texts[String(pair[0])])
          : "#" + pair[0] + (entry.labels[String(pair[0])] ?
            " (" + entry.labels[String(pair[0])] + ")" : "");
        return label + " " + fmt(pair[1]);
      }).join(", ");
      panel.appendChild(block);
    });
  }

  // A top-k block whose entries are key positions (attention per head): an option of the
  // colour selector that shades every token by how much the pointed token attends to it.
  function keyOptions(select, data) {
    data.top_k.forEach(function (entry, i) {
      if (!entry.keys) { return; }
      var option = document.createElement("option");
      option.value = "k" + i;
      option.textContent = entry.name + ": attention of the pointed token";
      select.appendChild(option);
    });
  }

  // offset: the sequence position of the first token shown (the live page shows the reply
  // from the prompt's last token on); keys before it shade nothing.
  function attended(spans, entry, p, offset) {
    var weights = {};
    (entry.rows[p] || []).forEach(function (pair) { weights[pair[0] - (offset || 0)] = pair[1]; });
    spans.forEach(function (span) {
      var w = weights[Number(span.getAttribute("data-i"))];
      var t = finite(w) ? Math.min(1, Math.max(0, w)) : null;
      span.style.backgroundColor = t === null ? "" : shade(t);
      span.style.color = t !== null && t > 0.6 ? "#ffffff" : "";
    });
  }

  function start(root) {
    if (root.getAttribute("data-ph-ready")) { return; }
    root.setAttribute("data-ph-ready", "1");
    root.querySelectorAll(".ph-request").forEach(function (request) {
      var script = request.querySelector("script.ph-data");
      if (!script) { return; }  // the live page keeps its own data
      var data = JSON.parse(script.textContent);
      var spans = request.querySelectorAll(".ph-token");
      var panel = request.querySelector(".ph-panel");
      var select = request.querySelector("select.ph-series");
      var pointed = data.n_prompt;  // the token whose attention a key option shades
      function paint() {
        if (select.value.charAt(0) === "k") {
          attended(spans, data.top_k[Number(select.value.slice(1))], pointed);
          return;
        }
        var s = data.series[Number(select.value)];
        spans.forEach(function (span) { colour(span, s, Number(span.getAttribute("data-i"))); });
      }
      if (select) {
        keyOptions(select, data);
        select.addEventListener("change", paint);
      }
      function point(p) {
        describe(panel, data, p);
        pointed = p;
        if (select && select.value.charAt(0) === "k") { paint(); }
      }
      spans.forEach(function (span) {
        var p = Number(span.getAttribute("data-i"));
        span.addEventListener("mouseenter", function () { point(p); });
        span.addEventListener("click", function () {
          spans.forEach(function (s) { s.classList.remove("ph-picked"); });
          span.classList.add("ph-picked");
          point(p);
        });
      });
    });
  }

  // A token's marks: the flags and the stop on its row, steering from the first steered row.
  function mark(span, data, p) {
    var flagged = Object.keys(data.marks.flags).some(function (key) {
      return data.marks.flags[key].indexOf(p) >= 0;
    });
    span.classList.toggle("ph-flag", flagged);
    span.classList.toggle("ph-stop", !!data.marks.stop && data.marks.stop.position === p);
    var steered = data.marks.steered;
    span.classList.toggle("ph-steered", !!steered && p >= steered.from);
  }

  window.probehookView = {
    start: start, shade: shade, level: level, seriesTop: seriesTop, scaleOf: scaleOf,
    colour: colour, columns: columns, describe: describe, mark: mark, keyOptions: keyOptions,
    attended: attended
  };
  document.querySelectorAll(".ph-view").forEach(start);
})();
