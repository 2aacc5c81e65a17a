// probehook's per-token view. The page is drawn by Python (tokens already coloured by the
// first score); this script adds the score selector, the panel of the token under the pointer
// and the live painting of a streamed reply. No framework, no network.
(function () {
  "use strict";

  // The same colour rule as probehook/viewer/page.py: white to blue by t in [0, 1].
  function shade(t) {
    var c = [33, 102, 172];
    return "rgb(" + c.map(function (x) { return Math.floor(255 + (x - 255) * t + 0.5); })
      .join(", ") + ")";
  }

  function level(value, scale, top) {
    if (value === null || value === undefined) { return null; }
    var t = scale === "logprob" ? Math.exp(value)
      : scale === "activation" ? (top > 0 ? value / top : 0) : value;
    return Math.min(1, Math.max(0, t));
  }

  function seriesTop(series) {
    var top = 0;
    series.values.forEach(function (v) { if (v !== null && v > top) { top = v; } });
    return top;
  }

  function colour(span, series, position) {
    var t = series ? level(series.values[position], series.scale, seriesTop(series)) : null;
    span.style.backgroundColor = t === null ? "" : shade(t);
    span.style.color = t !== null && t > 0.6 ? "#ffffff" : "";  // page.py's DARK
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
      row(table, ["steered", Object.keys(steered.vectors).map(function (name) {
        return name + " x" + steered.vectors[name];
      }).join(", ")]);
    }
    Object.keys(data.marks.clamp || {}).forEach(function (sae) {
      var held = data.marks.clamp[sae];
      row(table, ["clamped", sae + " " + Object.keys(held).map(function (f) {
        return "#" + f + "=" + held[f];
      }).join(", ")]);
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
      function paint() {
        var s = data.series[Number(select.value)];
        spans.forEach(function (span) { colour(span, s, Number(span.getAttribute("data-i"))); });
      }
      if (select) { select.addEventListener("change", paint); }
      spans.forEach(function (span) {
        var p = Number(span.getAttribute("data-i"));
        span.addEventListener("mouseenter", function () { describe(panel, data, p); });
        span.addEventListener("click", function () {
          spans.forEach(function (s) { s.classList.remove("ph-picked"); });
          span.classList.add("ph-picked");
          describe(panel, data, p);
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
    start: start, shade: shade, level: level, seriesTop: seriesTop, colour: colour,
    describe: describe, mark: mark
  };
  document.querySelectorAll(".ph-view").forEach(start);
})();
