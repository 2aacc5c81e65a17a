// probehook serve --ui: a chat box whose reply is painted token by token as its chunks arrive.
// It reads GET /v1/probehook (what the server has: probes, SAEs, lenses, steering vectors),
// sends a streamed chat completion with the choices in its "probehook" object, and keeps the
// reply as the viewer's data: tokens by position (the first stands for the prompt's last
// token, where decode row 0 is computed), one series per score, the top-k rows, the marks
// (flags, the stop, steering). More "probehook" options (monitors, clamp, ...) and labels of
// SAE features are typed in as JSON.
(function () {
  "use strict";
  var view = window.probehookView;
  var root = document.querySelector(".ph-live");
  var reply = document.getElementById("ph-reply");
  var status = document.getElementById("ph-status");
  var panel = root.querySelector(".ph-panel");
  var select = root.querySelector("select.ph-series");
  var info = null, model = null, data = null;
  // a completion's steering keys that are steering's own (outputs/intervention.py)
  var STEERING_KEYS = ["vectors", "phase", "gate", "start", "ops"];  // outputs/intervention.py

  function readouts() { return (info && info.readouts) || {}; }

  function checkbox(group, name) {
    var label = document.createElement("label");
    var box = document.createElement("input");
    box.type = "checkbox";
    box.checked = true;
    box.setAttribute("data-group", group);
    box.value = name;
    label.appendChild(box);
    label.appendChild(document.createTextNode(" " + group + " " + name + " "));
    document.getElementById("ph-choices").appendChild(label);
  }

  function chosen(group) {
    return Array.prototype.slice.call(
      root.querySelectorAll("input[data-group='" + group + "']:checked"))
      .map(function (box) { return box.value; });
  }

  function fresh() {
    return { tokens: ["\u23ce"], ids: [null], n_prompt: 1, series: [], top_k: [],
             marks: { flags: {}, stop: null, steered: null, writes: {} }, named: {} };
  }

  // A text box's JSON object ({} when empty); throws with the box named when it is not one.
  function jsonOf(id) {
    var text = document.getElementById(id).value.trim();
    if (!text) { return {}; }
    var value = JSON.parse(text);
    if (value === null || typeof value !== "object" || Array.isArray(value)) {
      throw new Error(id + " must be a JSON object");
    }
    return value;
  }

  function seriesOf(name, scale) {
    if (!(name in data.named)) {
      var s = { name: name, scale: scale, values: data.tokens.map(function () { return null; }) };
      data.named[name] = s;
      data.series.push(s);
      var option = document.createElement("option");
      option.value = String(data.series.length - 1);
      option.textContent = name;
      select.appendChild(option);
    }
    return data.named[name];
  }

  function topKOf(name, tokens, labels, keys) {
    var found = data.top_k.filter(function (t) { return t.name === name; })[0];
    if (!found) {
      found = { name: name, tokens: tokens, rows: data.tokens.map(function () { return null; }),
                labels: labels || {}, texts: {}, keys: !!keys };
      data.top_k.push(found);
      if (keys) {  // attention's key positions: shade the tokens the pointed one attends to
        var option = document.createElement("option");
        option.value = "k" + (data.top_k.length - 1);
        option.textContent = name + ": attention of the pointed token";
        select.appendChild(option);
      }
    }
    return found;
  }

  // A labelled entry of a top-k block: a series of its value on each token (0 where it is
  // not among the kept), as the notebook view's.
  function labelled(name, labels, row, position) {
    Object.keys(labels).forEach(function (entry) {
      var s = seriesOf(name + " #" + entry + " " + labels[entry], "activation");
      var hit = row.filter(function (pair) { return String(pair[0]) === entry; });
      s.values[position] = hit.length ? hit[0][1] : 0;
    });
  }

  function grow(count) {
    data.series.forEach(function (s) { while (s.values.length < count) { s.values.push(null); } });
    data.top_k.forEach(function (t) { while (t.rows.length < count) { t.rows.push(null); } });
  }

  // The chunk's readings: decode rows first..first + n - 1, at those positions; flags name
  // decode rows of the whole reply, so they are positions as they are.
  function place(readings, first, state) {
    var flagged = ["probe_flags", "feature_flags"];  // and each readout's monitors'
    Object.keys(readouts()).forEach(function (key) {
      if (readouts()[key].flags) { flagged.push(readouts()[key].flags); }
    });
    flagged.forEach(function (attribute) {
      Object.keys(readings[attribute] || {}).forEach(function (key) {
        var name = attribute.split("_")[0] + " " + key;
        var rows = data.marks.flags[name] || (data.marks.flags[name] = []);
        readings[attribute][key].forEach(function (r) { if (rows.indexOf(r) < 0) { rows.push(r); } });
      });
    });
    var steering = readings.steering;
    if (steering) {
      var vectors = steering.vectors || {};
      if (Object.keys(vectors).length && steering.start !== null && steering.start !== undefined) {
        // start is a position among prompt and reply; position 0 here is the prompt's last
        var from = state.nPrompt ? Math.max(0, steering.start - (state.nPrompt - 1)) : 0;
        data.marks.steered = { from: from, vectors: vectors, ops: steering.ops || {} };
      }
      // what each write-table entry applied (clamp, ...), on every token
      Object.keys(steering).forEach(function (option) {
        if (STEERING_KEYS.indexOf(option) < 0 && steering[option]) {
          data.marks.writes[option] = option + " " + JSON.stringify(steering[option]);
        }
      });
    }
    // one series per probe, one per class of a multi-class probe (as the notebook view)
    Object.keys(readings.probe_scores || {}).forEach(function (name) {
      readings.probe_scores[name].forEach(function (v, i) {
        (Array.isArray(v) ? v : [v]).forEach(function (x, c) {
          var label = Array.isArray(v) ? "probe " + name + "[" + c + "]" : "probe " + name;
          seriesOf(label, "score").values[first + i] = x;
        });
      });
    });
    // every top-k readout the server describes (lenses, the next ones): its columns where
    // its description says they sit, its scalar as a series where it names one
    Object.keys(readouts()).forEach(function (key) {
      var r = readouts()[key], value = readings[r.attribute];
      if (!value) { return; }
      Object.keys(r.served).forEach(function (instance) {
        var columns = r.served[instance].reduce(function (at, step) {
          return at === undefined ? undefined : at[step];
        }, value);
        if (!columns) { return; }
        var ids = view.columns(columns[r.columns[0]]);
        var values = view.columns(columns[r.columns[1]]);
        var scalars = view.columns(columns[r.columns[2]]);
        // a top-k per head (lead axes: [n, heads, k]): a block and a series per head
        var heads = ids.length && Array.isArray(ids[0][0]) ? ids[0].length : 0;
        var labels = state.labels[instance] || {};
        // the heads a request chose (attention_heads) are named by the served labels
        var numbers = (columns.labels || {}).heads || [];
        (heads ? Array.from({ length: heads }, function (_, h) { return h; }) : [null])
          .forEach(function (h) {
            var shown = h !== null && numbers.length === heads ? numbers[h] : h;
            var name = r.name + " " + instance + (h === null ? "" : " h" + shown);
            var t = topKOf(name, r.tokens, labels, r.positions);
            ids.forEach(function (row, i) {
              var mine = h === null ? row : row[h], vals = h === null ? values[i] : values[i][h];
              t.rows[first + i] = [];
              mine.forEach(function (id, j) {
                if (id < 0) { return; }  // padding
                if (r.tokens) {
                  t.texts[String(id)] = columns.tokens ? columns.tokens[i][j] : "<" + id + ">";
                }
                t.rows[first + i].push([id, vals[j]]);
              });
              labelled(name, labels, t.rows[first + i], first + i);
            });
            if (r.series) {
              var s = seriesOf(name + " " + r.series[0], r.series[1]);
              scalars.forEach(function (v, i) { s.values[first + i] = h === null ? v : v[h]; });
            }
          });
        // further per-token columns the readout shows as series (a second scalar)
        Object.keys(r.column_series || {}).forEach(function (column) {
          var s = seriesOf(r.name + " " + instance + " " + column, r.column_series[column]);
          view.columns(columns[column]).forEach(function (v, i) { s.values[first + i] = v; });
        });
      });
    });
  }

  var pointed = 0;  // the token whose attention a key option shades

  function paint() {
    var spans = reply.querySelectorAll(".ph-token");
    if (select.value.charAt(0) === "k") {  // position 0 stands for the prompt's last token
      view.attended(spans, data.top_k[Number(select.value.slice(1))], pointed, data.offset);
      spans.forEach(function (span) { view.mark(span, data, Number(span.getAttribute("data-i"))); });
      return;
    }
    var s = data.series[Number(select.value)] || data.series[0];
    spans.forEach(function (span) {
      var p = Number(span.getAttribute("data-i"));
      view.colour(span, s, p);
      view.mark(span, data, p);
    });
  }

  function span(p, text) {
    var s = document.createElement("span");
    s.className = "ph-token " + (p === 0 ? "ph-prompt" : "ph-output");
    s.setAttribute("data-i", String(p));
    s.textContent = text;
    s.addEventListener("mouseenter", function () {
      view.describe(panel, data, p);
      pointed = p;
      if (select.value.charAt(0) === "k") { paint(); }
    });
    reply.appendChild(s);
  }

  function addToken(text, id) {
    data.tokens.push(text);
    data.ids.push(id === undefined ? null : id);
    grow(data.tokens.length);
    span(data.tokens.length - 1, text);
  }

  function chunk(message, state) {
    if (message.usage && message.usage.prompt_tokens) {
      state.nPrompt = message.usage.prompt_tokens;
      data.offset = state.nPrompt - 1;  // the sequence position of token 0 here
    }
    var choice = (message.choices || [])[0];
    if (!choice) { return; }
    var texts = ((choice.logprobs || {}).content || []).map(function (c) { return c.token; });
    if (!texts.length && choice.delta && choice.delta.content) { texts = [choice.delta.content]; }
    var readings = choice.probehook || {};
    var rows = Math.max(0, texts.length);
    var ids = choice.token_ids || [];  // vLLM's return_token_ids: the chunk's token ids
    texts.forEach(function (text, i) { addToken(text, ids[i]); });
    // decode row i is at position i (position 0 stands for the prompt's last token)
    place(readings, state.rows, state);
    state.rows += rows;
    if (choice.finish_reason) {
      var reason = choice.stop_reason;
      if (typeof reason === "string" && /^(probe|feature|lens):/.test(reason)) {
        // a stop monitor crossed on the last decode row; the forced token came out of it
        data.marks.stop = { position: state.rows - 1, reason: reason };
      }
      status.textContent = "finish: " + choice.finish_reason +
        (data.marks.stop ? "; stopped by " + data.marks.stop.reason : "");
    }
    paint();
  }

  function send() {
    data = fresh();
    reply.textContent = "";
    select.textContent = "";
    span(0, data.tokens[0]);  // the prompt's last token, where decode row 0 is computed
    var options = { probes: chosen("probe") };
    Object.keys(readouts()).forEach(function (key) {  // each readout's picking option
      var r = readouts()[key], names = chosen(r.name);
      if (names.length) { options[r.options[0]] = names; }
    });
    var steer = chosen("steer");
    if (steer.length) {
      var scale = Number(document.getElementById("ph-scale").value);
      options.steer = {};
      steer.forEach(function (name) { options.steer[name] = scale; });
    }
    var extra, labels;
    try {
      extra = jsonOf("ph-extra");
      labels = jsonOf("ph-labels");
    } catch (error) {
      status.textContent = "error: " + error.message;
      return;
    }
    if (!options.probes.length) { delete options.probes; }
    Object.keys(extra).forEach(function (key) { options[key] = extra[key]; });
    var body = {
      model: model, stream: true, temperature: 0, logprobs: true, return_token_ids: true,
      max_tokens: Number(document.getElementById("ph-max").value),
      messages: [{ role: "user", content: document.getElementById("ph-message").value }],
      stream_options: { include_usage: true, continuous_usage_stats: true },  // prompt length
      probehook: options
    };
    status.textContent = "streaming";
    var state = { rows: 0, nPrompt: null, labels: labels };
    fetch("/v1/chat/completions", {
      method: "POST", headers: headers({ "Content-Type": "application/json" }),
      body: JSON.stringify(body)
    }).then(function (response) {
      if (!response.ok) {
        return response.text().then(function (text) { status.textContent = "error: " + text; });
      }
      var reader = response.body.getReader(), decoder = new TextDecoder(), buffer = "";
      // Each chunk is painted in a task of its own, also when a read holds many (a reply that
      // came faster than the page read it still appears token by token).
      function paintLines(lines) {
        var line = lines.shift();
        if (line === undefined) { return Promise.resolve(); }
        if (line.indexOf("data: ") === 0) {
          var payload = line.slice(6).trim();
          if (payload === "[DONE]") {
            root.setAttribute("data-ph-done", "1");
          } else {
            chunk(JSON.parse(payload), state);
          }
        }
        return new Promise(function (resolve) { setTimeout(resolve, 0); }).then(function () {
          return paintLines(lines);
        });
      }
      function pump() {
        return reader.read().then(function (got) {
          buffer += decoder.decode(got.value || new Uint8Array(), { stream: !got.done });
          var lines = buffer.split("\n");
          buffer = got.done ? "" : lines.pop();
          return paintLines(lines).then(function () {
            if (!got.done) { return pump(); }
            root.setAttribute("data-ph-done", "1");
          });
        });
      }
      return pump();
    }).catch(function (error) { status.textContent = "error: " + error; });
  }

  // The server's API key (probehook serve --api-key guards /v1), typed in where it asks.
  var key = document.getElementById("ph-key");

  function headers(more) {
    var out = more || {};
    if (key.value) { out.Authorization = "Bearer " + key.value; }
    return out;
  }

  function getJSON(path) {
    return fetch(path, { headers: headers() }).then(function (r) {
      if (r.status === 401) { throw new Error("unauthorized"); }
      if (!r.ok) { throw new Error(path + " answered " + r.status); }
      return r.json();
    });
  }

  select.addEventListener("change", paint);
  document.getElementById("ph-send").addEventListener("click", send);
  key.addEventListener("change", load);
  load();

  function load() {
    document.getElementById("ph-choices").textContent = "";
    Promise.all([getJSON("/v1/probehook"), getJSON("/v1/models")]).then(function (got) {
      ready(got[0], got[1]);
    }).catch(function (error) {
      if (error.message === "unauthorized") {
        key.parentNode.hidden = false;
        status.textContent = key.value ? "error: the server refused this API key"
          : "this server asks for its API key (probehook serve --api-key): type it in above";
      } else {
        status.textContent = "error: " + error.message;
      }
    });
  }

  function ready(described, models) {
    info = described;
    model = models.data[0].id;
    status.textContent = "";
    Object.keys(info.probes || {}).forEach(function (name) { checkbox("probe", name); });
    Object.keys(readouts()).forEach(function (key) {
      var r = readouts()[key];
      r.names.forEach(function (name) { checkbox(r.name, name); });
    });
    Object.keys((info.steering || {}).vectors || {}).forEach(function (name) {
      checkbox("steer", name);
    });
    root.querySelectorAll("input[data-group='steer']").forEach(function (box) {
      box.checked = false;
    });
    root.setAttribute("data-ph-ready", "1");
  }
})();
