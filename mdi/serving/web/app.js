/* mdi dashboard: polls GET v1/mdi/state (the snapshot behind /metrics) once a second, draws
   the ring, the nodes and four charts, and streams chat answers from v1/chat/completions.
   No dependencies. With a shared secret the token is asked for once, kept in this tab's
   sessionStorage and sent as "Authorization: Bearer" on every request, never in a URL.
   Text from the server (node names, errors, answers) only ever goes into textContent. */
"use strict";
(function () {
  var TOKEN_KEY = "mdi-token";
  var POLL_MS = 1000;
  var HISTORY = 180; // points per chart (3 minutes at one poll a second)
  var MIN_WINDOW = 60; // a chart's width holds at least this many points (it fills up, then scrolls)
  var SVGNS = "http://www.w3.org/2000/svg";

  var info = null; // {auth: bool, mode: "serve" | "batch"} from v1/mdi/info (public, no data)
  var timer = null;
  var polling = false;
  var lastState = null;
  var series = { tps: [], inflight: [], queue: [], ttft: [] };
  var chat = { messages: [], controller: null };

  function $(id) { return document.getElementById(id); }

  function el(tag, attrs, children) {
    var node = document.createElement(tag);
    setAttrs(node, attrs);
    append(node, children);
    return node;
  }

  function svg(tag, attrs, children) {
    var node = document.createElementNS(SVGNS, tag);
    setAttrs(node, attrs);
    append(node, children);
    return node;
  }

  function setAttrs(node, attrs) {
    Object.keys(attrs || {}).forEach(function (k) {
      if (attrs[k] === null || attrs[k] === undefined || attrs[k] === false) return;
      if (k === "text") node.textContent = attrs[k];
      else node.setAttribute(k, attrs[k]);
    });
  }

  function append(node, children) {
    (children || []).forEach(function (c) {
      if (c === null || c === undefined) return;
      node.appendChild(typeof c === "string" ? document.createTextNode(c) : c);
    });
  }

  function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }

  // --- formatting -----------------------------------------------------------------------
  function num(v, digits) { return v === null || v === undefined ? "\u2013" : Number(v).toFixed(digits); }
  function bytes(v) {
    if (v === null || v === undefined) return "\u2013";
    var units = ["B", "KiB", "MiB", "GiB", "TiB"], i = 0;
    while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    return (i === 0 ? v : v.toFixed(v < 10 ? 2 : v < 100 ? 1 : 0)) + " " + units[i];
  }
  function seconds(v) {
    if (v === null || v === undefined) return "\u2013";
    return v < 1 ? (v * 1000).toFixed(0) + " ms" : v.toFixed(2) + " s";
  }
  function percent(v) { return v === null || v === undefined ? "\u2013" : (v * 100).toFixed(0) + "%"; }
  // A node's half-open layer range [first, last) as every text of mdi shows it (the twin of
  // mdi.model.layout.layer_span): the state's `layers` is that pair, as in a worker's /status.
  function layerSpan(l) { return "[" + l[0] + ", " + l[1] + ")"; }
  function layers(l) { return l ? layerSpan(l) + " (" + (l[1] - l[0]) + ")" : "\u2013"; }
  function duration(s) {
    s = Math.floor(s || 0);
    var h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), r = s % 60;
    return (h ? h + "h " : "") + (h || m ? m + "m " : "") + r + "s";
  }

  // --- the token --------------------------------------------------------------------------
  function token() {
    try { return window.sessionStorage.getItem(TOKEN_KEY); } catch (e) { return null; }
  }
  function setToken(t) {
    try {
      if (t) window.sessionStorage.setItem(TOKEN_KEY, t); else window.sessionStorage.removeItem(TOKEN_KEY);
    } catch (e) { /* storage disabled: the token lives only as long as this page */ }
  }
  function headers(extra) {
    var h = {};
    Object.keys(extra || {}).forEach(function (k) { h[k] = extra[k]; });
    var t = token();
    if (t) h.Authorization = "Bearer " + t;
    return h;
  }

  function showLogin(refused) {
    stopPolling();
    resetView();
    $("main").hidden = true;
    $("login").hidden = false;
    $("login-error").hidden = !refused;
    setPill("locked", "token needed");
    $("token-input").focus();
  }

  function unauthorized() {
    var hadToken = !!token();
    setToken(null);
    showLogin(hadToken);
  }

  function banner(text) {
    $("banner").textContent = text || "";
    $("banner").hidden = !text;
  }

  function setPill(state, text) {
    var pill = $("ring-state");
    pill.setAttribute("data-state", state);
    pill.textContent = text || state;
  }

  // --- polling ----------------------------------------------------------------------------
  function startPolling() {
    $("login").hidden = true;
    $("main").hidden = false;
    stopPolling();
    polling = true;
    poll();
  }

  function stopPolling() {
    polling = false;
    if (timer !== null) { clearTimeout(timer); timer = null; }
  }

  function poll() {
    if (!polling) return;
    fetch("v1/mdi/state", { headers: headers(), cache: "no-store" }).then(function (resp) {
      if (resp.status === 401) { unauthorized(); return null; }
      if (!resp.ok) throw new Error("HTTP " + resp.status);
      return resp.json();
    }).then(function (state) {
      if (!state || !polling) return;
      banner("");
      render(state);
    }).catch(function () {
      banner("Cannot reach the starter: retrying. (A batch run's page goes away when the run ends.)");
      setPill("offline", "offline");
    }).then(function () {
      if (polling) timer = setTimeout(poll, POLL_MS);
    });
  }

  // --- rendering --------------------------------------------------------------------------
  function resetView() {
    lastState = null;
    Object.keys(series).forEach(function (k) { series[k] = []; });
    ["s-tps", "s-inflight", "s-slots", "s-queue", "s-ttft", "s-tokens", "s-extra", "c-tps", "c-inflight",
     "c-queue", "c-ttft", "s-spec-accepted", "s-spec-drafted", "s-spec-rate", "s-spec-per-pass"].forEach(function (id) { $(id).textContent = "\u2013"; });
    ["m-tps", "m-inflight", "m-queue", "m-ttft", "model", "updated"].forEach(function (id) { $(id).textContent = ""; });
    clear($("ring-svg"));
    clear($("nodes"));
    clear($("slots"));
    ["chart-tps", "chart-inflight", "chart-queue", "chart-ttft"].forEach(function (id) { clear($(id)); });
    renderRecoveries([], null);
    $("progress").hidden = true;
  }

  function render(s) {
    lastState = s;
    $("model").textContent = s.model + " \u00b7 " + s.mode;
    setPill(s.state, s.state);
    $("s-tps").textContent = num(s.tokens_per_second, 1);
    $("s-inflight").textContent = String(s.in_flight);
    $("s-slots").textContent = String(s.slots);
    $("s-queue").textContent = String(s.queue_length);
    $("s-ttft").textContent = seconds(s.ttft_recent_seconds);
    $("s-tokens").textContent = String(s.tokens_total);
    var pc = s.prefix_cache || {};
    $("s-cache").textContent = pc.prompt_tokens ? percent(pc.tokens_reused / pc.prompt_tokens) : "\u2013";
    renderSpeculation(s.speculation || {});
    if (s.mode === "batch" && s.progress) {
      $("s-extra-label").textContent = "samples done";
      $("s-extra").textContent = s.progress.samples_done + " / " + s.progress.samples;
      $("progress").hidden = false;
      var share = s.progress.tokens_max ? Math.min(1, s.progress.tokens / s.progress.tokens_max) : 0;
      $("progress-bar").style.width = (share * 100).toFixed(1) + "%";
      $("progress-text").textContent = s.progress.tokens + " / " + s.progress.tokens_max + " tokens at most";
    } else {
      var total = 0;
      Object.keys(s.requests || {}).forEach(function (k) { total += s.requests[k]; });
      $("s-extra-label").textContent = "requests done";
      $("s-extra").textContent = String(total);
    }
    $("updated").textContent = "updated " + new Date(s.time * 1000).toLocaleTimeString() +
      " \u00b7 up " + duration(s.uptime_seconds);
    push(series.tps, s.tokens_per_second);
    push(series.inflight, s.in_flight);
    push(series.queue, s.queue_length);
    push(series.ttft, s.ttft_recent_seconds);
    renderRing(s);
    renderSlots(s.slots, s.in_flight);
    renderNodes(s.nodes);
    renderCharts(s);
    renderTraining(s.training);
    renderRecoveries(s.recoveries, s.last_error);
  }

  // A training job beside serving (POST /v1/mdi/train): its loss per step, its state and ETA.
  function renderTraining(t) {
    $("training").hidden = !t;
    if (!t) return;
    $("t-state").textContent = "\u00b7 " + t.state + " \u00b7 step " + t.step + " / " + t.steps +
      (t.eta_s !== null && t.eta_s !== undefined ? " \u00b7 eta " + duration(t.eta_s) : "") +
      (t.error ? " \u00b7 " + t.error : "");
    chart("loss", t.loss.slice(-HISTORY), null, function (v) { return num(v, 4); });
  }

  // Speculative decoding's counters (the snapshot's `speculation`, /metrics' mdi_speculation_*):
  // dashes until something was drafted (speculation off, or every draft paused).
  function renderSpeculation(sp) {
    var any = sp.drafted > 0;
    $("s-spec-accepted").textContent = any ? String(sp.accepted) : "\u2013";
    $("s-spec-drafted").textContent = any ? String(sp.drafted) : "\u2013";
    $("s-spec-rate").textContent = any ? percent(sp.acceptance_rate) : "\u2013";
    $("s-spec-per-pass").textContent = any ? num(sp.accepted_per_pass, 2) : "\u2013";
    $("s-spec-stale").textContent = any ? String(sp.passes_stale) : "\u2013";
    $("s-spec-wasted").textContent = any ? String(sp.rows_wasted) : "\u2013";
  }

  function push(list, v) {
    list.push(v === undefined ? null : v);
    while (list.length > HISTORY) list.shift();
  }

  function ringNodes(nodes) {
    return nodes.filter(function (n) { return n.role === "starter" || n.role === "worker"; })
      .sort(function (a, b) { return a.position - b.position; });
  }

  function renderRing(s) {
    var root = $("ring-svg");
    clear(root);
    var ring = ringNodes(s.nodes);
    var extras = s.nodes.filter(function (n) { return n.role !== "starter" && n.role !== "worker"; });
    var n = ring.length;
    var cx = 210, cy = extras.length ? 190 : 205, R = extras.length ? 132 : 145;
    var r = n > 6 ? Math.max(20, 34 - (n - 6) * 3) : 34;
    var flowing = (s.tokens_per_second || 0) > 0 && s.in_flight > 0;
    root.appendChild(svg("defs", {}, [
      svg("marker", { id: "arrow", viewBox: "0 0 10 10", refX: "7", refY: "5", markerWidth: "5", markerHeight: "5",
                      orient: "auto" }, [svg("path", { d: "M0,0 L10,5 L0,10 z", fill: "#4f8cff" })])
    ]));
    var pos = ring.map(function (node, i) {
      var a = -Math.PI / 2 + (2 * Math.PI * i) / Math.max(n, 1);
      return { a: a, x: cx + R * Math.cos(a), y: cy + R * Math.sin(a) };
    });
    // Edges: node i -> node i+1 along the circle (the data plane's direction).
    var trim = (r + 10) / R;
    for (var i = 0; i < n; i++) {
      var a0 = pos[i].a + trim, span = (2 * Math.PI) / n - 2 * trim;
      if (span <= 0.05) continue;
      var a1 = a0 + span;
      var d = "M" + (cx + R * Math.cos(a0)).toFixed(1) + "," + (cy + R * Math.sin(a0)).toFixed(1) +
        " A" + R + "," + R + " 0 " + (span > Math.PI ? 1 : 0) + " 1 " +
        (cx + R * Math.cos(a1)).toFixed(1) + "," + (cy + R * Math.sin(a1)).toFixed(1);
      root.appendChild(svg("path", { d: d, "class": "ring-edge" + (flowing ? " flowing" : ""),
                                     "marker-end": "url(#arrow)" }));
    }
    root.appendChild(svg("text", { x: cx, y: cy - 4, "class": "svg-center-big", text: num(s.tokens_per_second, 1) }));
    root.appendChild(svg("text", { x: cx, y: cy + 16, "class": "svg-center", text: "tokens/s" }));
    root.appendChild(svg("text", { x: cx, y: cy + 34, "class": "svg-center",
                                   text: s.in_flight + " / " + s.slots + " in flight" }));
    ring.forEach(function (node, i) { root.appendChild(nodeGlyph(node, pos[i].x, pos[i].y, r)); });
    extras.slice(0, 4).forEach(function (node, k) {
      var x = 24 + k * 100, y = 404;
      root.appendChild(svg("g", { "data-node": node.name }, [
        svg("circle", { cx: x, cy: y, r: 9, "class": "node-disc " + node.state }),
        svg("text", { x: x + 14, y: y + 4, "class": "svg-extra-label",
                      text: short(node.name, 8) + " \u00b7 " + stateLabel(node) })
      ]));
    });
  }

  function short(text, max) { return text.length > max ? text.slice(0, max - 1) + "\u2026" : text; }

  function nodeGlyph(node, x, y, r) {
    var g = svg("g", { "class": "ring-node", "data-node": node.name, "data-state": node.state });
    var ringR = r + 6, circ = 2 * Math.PI * ringR;
    g.appendChild(svg("circle", { cx: x, cy: y, r: ringR, "class": "busy-track" }));
    if (node.busy_share && node.busy_share >= 0.005) {
      g.appendChild(svg("circle", {
        cx: x, cy: y, r: ringR, "class": "busy-arc", transform: "rotate(-90 " + x + " " + y + ")",
        "stroke-dasharray": (node.busy_share * circ).toFixed(1) + " " + circ.toFixed(1)
      }));
    }
    g.appendChild(svg("circle", { cx: x, cy: y, r: r, "class": "node-disc " + node.state }));
    g.appendChild(svg("text", { x: x, y: y - 2, "class": "svg-name", text: short(node.name, 9) }));
    g.appendChild(svg("text", { x: x, y: y + 13, "class": "svg-sub",
                                text: node.layers ? layerSpan(node.layers) : "" }));
    var below = node.state === "down" ? "DOWN" :
      percent(node.busy_share) + " busy" + (node.step_seconds ? " \u00b7 " + seconds(node.step_seconds) : "");
    g.appendChild(svg("text", { x: x, y: y + r + 20, "class": "svg-sub", text: below }));
    g.appendChild(svg("title", { text: node.name + " (" + node.host + ":" + node.port + "): " + stateLabel(node) }));
    return g;
  }

  function stateLabel(node) {
    if (node.state === "replaced") return node.reachable ? "replaced" : "replaced \u00b7 down";
    if (node.state === "spare") return node.reachable ? "spare" : "spare \u00b7 down";
    return node.state;
  }

  function renderSlots(slots, inFlight) {
    var root = $("slots");
    clear(root);
    var shown = Math.min(slots, 64);
    for (var i = 0; i < shown; i++) {
      root.appendChild(el("span", { "class": "slot" + (i < inFlight ? " busy" : "") }));
    }
    root.setAttribute("data-in-flight", String(inFlight));
    root.setAttribute("title", inFlight + " of " + slots + " slots in use");
  }

  function meter(share, cls) {
    var bar = el("div");
    bar.style.width = (Math.max(0, Math.min(1, share || 0)) * 100).toFixed(1) + "%";
    return el("div", { "class": "meter" + (cls ? " " + cls : "") }, [bar]);
  }

  function renderNodes(nodes) {
    var root = $("nodes");
    clear(root);
    var ring = ringNodes(nodes);
    var others = nodes.filter(function (n) { return ring.indexOf(n) < 0; });
    ring.concat(others).forEach(function (node) {
      var rows = [];
      function row(label, value, extra) {
        rows.push(el("dt", { text: label }));
        rows.push(el("dd", {}, [value].concat(extra || [])));
      }
      row("host", node.host + ":" + node.port);
      row("role", node.role + (node.worker_state ? " (" + node.worker_state + ")" : ""));
      row("device", node.device || "\u2013");
      if (node.dtype) {
        row("dtype", node.dtype + (node.compute_dtype && node.compute_dtype !== node.dtype ?
          ", computes in " + node.compute_dtype : ""));
      }
      row("layers", layers(node.layers));
      if (node.backend) {  // what its layers compute with (mdi.model.backend), and why on hover
        rows.push(el("dt", { text: "backend" }));
        rows.push(el("dd", { "class": "backend", title: node.backend_line || "", text: node.backend }));
      }
      if (node.role === "starter" || node.role === "worker") {
        row("busy", percent(node.busy_share), [meter(node.busy_share)]);
        row("compute", node.step_seconds ? seconds(node.step_seconds) + " per step" : "\u2013");
        row("frames/s", num(node.frames_per_second, 1));
      }
      if (node.memory_used_bytes !== undefined) {
        var memShare = node.memory_limit_bytes ? node.memory_used_bytes / node.memory_limit_bytes : 0;
        row("memory", bytes(node.memory_used_bytes) + " / " + bytes(node.memory_limit_bytes),
            [meter(memShare, "mem" + (memShare > 0.85 ? " high" : ""))]);
      }
      if (node.board_memory_total_bytes) {
        row("board RAM", bytes(node.board_memory_used_bytes) + " / " + bytes(node.board_memory_total_bytes) +
          (node.board_memory_source ? " (" + node.board_memory_source + ")" : ""));
      }
      if (node.cache_bytes) row("KV cache", bytes(node.cache_bytes));
      if (node.prefix_cache_budget_bytes) {
        row("prefix cache", bytes(node.prefix_cache_bytes) + " / " + bytes(node.prefix_cache_budget_bytes) +
          " (" + node.prefix_cache_entries + " entries)");
      }
      if (node.bytes_sent !== undefined) {
        row("sent", bytes(node.bytes_sent) + " (" + (node.messages_sent || 0) + " frames)");
      }
      var card = el("article", { "class": "node", "data-node": node.name, "data-state": node.state,
                                 "data-reachable": String(!!node.reachable) }, [
        el("header", {}, [
          el("span", { "class": "idx", text: node.position === null || node.position === undefined ? "\u00b7" :
            "#" + node.position }),
          el("span", { "class": "name", text: node.name }),
          el("span", { "class": "badge " + node.state, text: stateLabel(node) })
        ]),
        el("dl", {}, rows),
        node.error ? el("p", { "class": "err", text: node.error }) : null
      ]);
      root.appendChild(card);
    });
  }

  function renderCharts(s) {
    chart("tps", series.tps, null, function (v) { return num(v, 1); });
    chart("inflight", series.inflight, s.slots, function (v) { return v === null ? "\u2013" : String(v); });
    chart("queue", series.queue, null, function (v) { return v === null ? "\u2013" : String(v); });
    chart("ttft", series.ttft, null, seconds);
  }

  function chart(name, values, limit, fmt) {
    var root = $("chart-" + name);
    clear(root);
    var W = 300, H = 80, pad = 4;
    var max = limit || 0;
    values.forEach(function (v) { if (v !== null && v > max) max = v; });
    max = max > 0 ? max * 1.1 : 1;
    var span = Math.max(values.length, MIN_WINDOW), step = W / (span - 1), offset = span - values.length;
    function x(i) { return ((offset + i) * step).toFixed(1); }
    function y(v) { return (H - pad - (v / max) * (H - 2 * pad)).toFixed(1); }
    if (limit) {
      root.appendChild(svg("line", { x1: 0, x2: W, y1: y(limit), y2: y(limit), "class": "limit" }));
    }
    var segment = [];
    function flush() {
      if (segment.length > 1) {
        var pts = segment.map(function (p) { return p.join(","); }).join(" ");
        var first = segment[0][0], last = segment[segment.length - 1][0];
        root.appendChild(svg("polygon", { points: first + "," + H + " " + pts + " " + last + "," + H, "class": "area" }));
        root.appendChild(svg("polyline", { points: pts, "class": "line" }));
      } else if (segment.length === 1) {
        root.appendChild(svg("circle", { cx: segment[0][0], cy: segment[0][1], r: 1.5, "class": "line" }));
      }
      segment = [];
    }
    values.forEach(function (v, i) {
      if (v === null) flush(); else segment.push([x(i), y(v)]);
    });
    flush();
    var current = values.length ? values[values.length - 1] : null;
    $("c-" + name).textContent = fmt(current);
    var seen = values.filter(function (v) { return v !== null; });
    $("m-" + name).textContent = seen.length ? "max " + fmt(Math.max.apply(null, seen)) : "";
  }

  function renderRecoveries(recoveries, lastError) {
    var body = $("recoveries-body");
    clear(body);
    if (!recoveries || !recoveries.length) {
      body.appendChild(el("tr", { "class": "empty" }, [el("td", { colspan: "4", text: "none" })]));
    } else {
      recoveries.slice().reverse().forEach(function (r) {
        body.appendChild(el("tr", { "class": "recovery" }, [
          el("td", { "class": "nowrap", text: r.at_s !== undefined ? r.at_s.toFixed(1) + " s" : "\u2013" }),
          el("td", { text: r.cause }),
          el("td", { text: r.action }),
          el("td", { text: num(r.seconds, 2) })
        ]));
      });
    }
    var p = $("last-error");
    if (lastError) {
      p.textContent = "Last error (" + lastError.where + ", " + new Date(lastError.time * 1000).toLocaleTimeString() +
        "): " + lastError.message;
      p.hidden = false;
    } else {
      p.textContent = "";
      p.hidden = true;
    }
  }

  // --- tabs -------------------------------------------------------------------------------
  function showTab(name) {
    ["ring", "chat"].forEach(function (t) {
      $("tab-" + t).setAttribute("aria-selected", String(t === name));
      $("panel-" + t).hidden = t !== name;
    });
    if (window.location.hash !== "#" + name) window.history.replaceState(null, "", "#" + name);
  }

  // --- chat -------------------------------------------------------------------------------
  function bubble(role, text) {
    var node = el("div", { "class": "msg " + role }, [el("span", { "class": "text", text: text })]);
    $("messages").appendChild(node);
    $("messages").scrollTop = $("messages").scrollHeight;
    return node;
  }

  function setting(id) {
    var v = $(id).value.trim();
    return v === "" ? null : Number(v);
  }

  // The schema toggle: response_format json_schema, its JSON checked here before sending. Not
  // strict: OpenAI's strict mode refuses schemas whose objects are open (the server follows it),
  // and a schema typed here is plain JSON Schema, followed as written.
  function responseFormat() {
    var error = $("schema-error");
    error.hidden = true;
    if (!$("set-schema-on").checked) return null;
    var schema;
    try { schema = JSON.parse($("set-schema").value); } catch (e) { schema = e; }
    if (schema instanceof Error || schema === null || typeof schema !== "object" || Array.isArray(schema)) {
      error.textContent = "The schema is not a JSON object" + (schema instanceof Error ? ": " + schema.message : "");
      error.hidden = false;
      return false;
    }
    return { type: "json_schema", json_schema: { name: "dashboard", schema: schema, strict: false } };
  }

  function showToolCalls(node, calls) {
    var box = node.querySelector(".tool-calls");
    if (!box) { box = el("div", { "class": "tool-calls" }); node.insertBefore(box, node.querySelector(".meta")); }
    clear(box);
    calls.forEach(function (c) {
      box.appendChild(el("div", { "class": "tool-call" }, [el("span", { "class": "tool-name", text: c.name }),
        el("code", { "class": "tool-args", text: c.arguments })]));
    });
  }

  function chatBody(format) {
    var messages = [];
    var system = $("set-system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    chat.messages.forEach(function (m) { if (m.content) messages.push(m); });
    var body = { messages: messages, stream: true, stream_options: { include_usage: true } };
    var t = setting("set-temperature"), p = setting("set-top-p"), k = setting("set-top-k");
    var n = setting("set-max-tokens"), seed = setting("set-seed");
    if (t !== null) body.temperature = t;
    if (p !== null && p < 1) body.top_p = p;
    if (k !== null && k > 0) body.top_k = Math.round(k);
    if (n !== null) body.max_tokens = Math.round(n);
    if (seed !== null) body.seed = Math.round(seed);
    if (format) body.response_format = format;
    return body;
  }

  function setBusy(busy) {
    $("send").disabled = busy;
    $("stop").disabled = !busy;
  }

  function send(event) {
    event.preventDefault();
    if (chat.controller) return;
    var text = $("chat-input").value;
    if (!text.trim()) return;
    var format = responseFormat();
    if (format === false) return;  // the schema is not JSON: said in the page, nothing sent
    $("chat-input").value = "";
    chat.messages.push({ role: "user", content: text });
    bubble("user", text);
    var answer = { role: "assistant", content: "" };
    chat.messages.push(answer);
    var node = bubble("assistant streaming", "");
    var textNode = node.querySelector(".text");
    var meta = el("span", { "class": "meta", text: "waiting for a slot\u2026" });
    node.appendChild(meta);
    var controller = new AbortController();
    chat.controller = controller;
    setBusy(true);
    var t0 = performance.now(), tFirst = null, chunks = 0, usage = null, finish = null, failure = null;

    function onEvent(data) {
      if (data === "[DONE]") return;
      var obj = JSON.parse(data);
      if (obj.error) { failure = obj.error.message; return; }
      if (obj.usage) usage = obj.usage;
      (obj.choices || []).forEach(function (c) {
        var piece = c.delta && c.delta.content;
        if (piece) {
          if (tFirst === null) tFirst = performance.now();
          chunks++;
          answer.content += piece;
          textNode.textContent = answer.content;
          meta.textContent = "streaming\u2026";
          $("messages").scrollTop = $("messages").scrollHeight;
        }
        ((c.delta && c.delta.tool_calls) || []).forEach(function (part) {  // name first, arguments in pieces
          var calls = answer.tool_calls = answer.tool_calls || [];
          var call = calls[part.index] = calls[part.index] || { name: "", arguments: "" };
          if (part.function && part.function.name) call.name += part.function.name;
          if (part.function && part.function.arguments) call.arguments += part.function.arguments;
          if (tFirst === null) tFirst = performance.now();
          showToolCalls(node, calls);
        });
        if (c.finish_reason) finish = c.finish_reason;
      });
    }

    fetch("v1/chat/completions", {
      method: "POST", cache: "no-store", signal: controller.signal,
      headers: headers({ "Content-Type": "application/json", Accept: "text/event-stream" }),
      body: JSON.stringify(chatBody(format))
    }).then(function (resp) {
      if (resp.status === 401) { unauthorized(); throw new Error("the token was refused"); }
      if (!resp.ok) {
        return resp.json().catch(function () { return null; }).then(function (j) {
          throw new Error(j && j.error ? j.error.message : "HTTP " + resp.status);
        });
      }
      var reader = resp.body.getReader(), decoder = new TextDecoder(), buffer = "";
      function pump() {
        return reader.read().then(function (part) {
          if (part.done) return;
          buffer += decoder.decode(part.value, { stream: true });
          var cut;
          while ((cut = buffer.indexOf("\n\n")) >= 0) {
            var block = buffer.slice(0, cut);
            buffer = buffer.slice(cut + 2);
            block.split("\n").forEach(function (line) {
              if (line.indexOf("data: ") === 0) onEvent(line.slice(6));
            });
          }
          return pump();
        });
      }
      return pump();
    }).then(function () {
      if (failure) throw new Error(failure);
      done(finish || "stop");
    }).catch(function (e) {
      if (e && e.name === "AbortError") done("stopped");
      else { node.classList.add("error"); done("error", e && e.message ? e.message : String(e)); }
    });

    function done(reason, message) {
      chat.controller = null;
      setBusy(false);
      node.classList.remove("streaming");
      var end = performance.now();
      var tokens = usage ? usage.completion_tokens : chunks;
      var parts = [];
      if (message) parts.push(message);
      parts.push((usage ? "" : "~") + tokens + " tokens");
      if (tFirst !== null && tokens > 1 && end > tFirst) {
        parts.push(((tokens - 1) / ((end - tFirst) / 1000)).toFixed(1) + " tokens/s");
      }
      if (tFirst !== null) parts.push("first token " + seconds((tFirst - t0) / 1000));
      parts.push(reason);
      meta.textContent = parts.join(" \u00b7 ");
      node.setAttribute("data-finish", reason);
      node.setAttribute("data-tokens", String(tokens));
    }
  }

  function stop() {
    if (chat.controller) chat.controller.abort();
  }

  function clearChat() {
    stop();
    chat.messages = [];
    clear($("messages"));
  }

  // --- start ------------------------------------------------------------------------------
  function start() {
    $("tab-ring").addEventListener("click", function () { showTab("ring"); });
    $("tab-chat").addEventListener("click", function () { showTab("chat"); });
    $("chat-form").addEventListener("submit", send);
    $("chat-input").addEventListener("keydown", function (e) {
      if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("chat-form").requestSubmit(); }
    });
    $("stop").addEventListener("click", stop);
    $("clear").addEventListener("click", clearChat);
    $("settings").addEventListener("submit", function (e) { e.preventDefault(); });
    $("login").addEventListener("submit", function (e) {
      e.preventDefault();
      var t = $("token-input").value.trim();
      if (!t) return;
      $("token-input").value = "";
      setToken(t);
      startPolling();
    });
    showTab(window.location.hash === "#chat" ? "chat" : "ring");
    fetch("v1/mdi/info", { cache: "no-store" }).then(function (resp) {
      if (!resp.ok) throw new Error("HTTP " + resp.status);
      return resp.json();
    }).then(function (i) {
      info = i;
      var batch = info.mode === "batch";
      $("chat-unavailable").hidden = !batch;
      $("chat-input").disabled = batch;
      $("send").disabled = batch;
      if (info.auth && !token()) showLogin(false); else startPolling();
    }).catch(function () {
      banner("Cannot reach the starter.");
      setPill("offline", "offline");
    });
  }

  document.addEventListener("DOMContentLoaded", start);
})();
