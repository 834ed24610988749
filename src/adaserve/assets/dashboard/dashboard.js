/* adaserve dashboard: renders one "view" (adaserve.util.dashboard_page.view) with uPlot.
   Sign-in mode (the server's 401 / 403 page) shows the form, which trades the admin key
   (sent once, as the Authorization header) for an HttpOnly session cookie and reloads;
   the key is kept nowhere. Live mode polls boot.data_url once a second with that
   cookie; static mode shows embedded runs. */
(function () {
  "use strict";
  var BOOT = JSON.parse(document.getElementById("dash-boot").textContent);
  // Okabe-Ito: distinguishable with the common colour-vision deficiencies
  var PALETTE = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000"];
  var DASHES = [[], [6, 3], [2, 2], [8, 3, 2, 3], [4, 4], [1, 3], [10, 2], [3, 6]];
  var $ = function (id) { return document.getElementById(id); };
  var charts = {};
  var timer = null;
  var lastView = null;

  function el(tag, attrs, text) {
    var e = document.createElement(tag);
    for (var k in attrs || {}) e.setAttribute(k, attrs[k]);
    if (text !== undefined && text !== null) e.textContent = text;
    return e;
  }
  function num(v, digits) {
    if (v === null || v === undefined || !isFinite(v)) return "\u2013";
    return Number(v).toFixed(digits);
  }
  function pct(v) { return v === null || v === undefined ? "\u2013" : num(100 * v, 1) + " %"; }
  function cell(tr, field, value, text, cls) {
    var td = el("td", { "data-field": field }, text);
    if (value !== null && value !== undefined) td.setAttribute("data-value", String(value));
    if (cls) td.className = cls;
    tr.appendChild(td);
    return td;
  }
  function get(o, path) {
    return path.split(".").reduce(function (a, k) { return a == null ? null : a[k]; }, o);
  }

  // ------------------------------------------------------------------ tables
  function renderOverall(v) {
    var box = $("overall");
    box.textContent = "";
    var e = v.engine || {};
    var items = [
      ["running", e.running, "requests running", 0],
      ["waiting", e.waiting, "requests waiting", 0],
      ["kv_usage", e.kv_usage === null || e.kv_usage === undefined ? null : 100 * e.kv_usage, "% KV cache used", 1],
      ["iterations", e.iterations, "iterations", 0],
    ];
    items.forEach(function (it) {
      var c = el("div", { "class": "card", "data-field": it[0] });
      var b = el("b", {}, num(it[1], it[3]));
      if (it[1] !== null && it[1] !== undefined) b.setAttribute("data-value", String(it[1]));
      c.appendChild(b);
      c.appendChild(el("span", {}, it[2]));
      box.appendChild(c);
    });
  }

  function renderClasses(v) {
    var t = $("classes");
    t.textContent = "";
    // two header rows: groups, then the columns (units in the group names)
    var groups = [
      ["class", 1, 2], ["requests", 1, 2], ["SLO attainment", 2], ["TTFT (ms)", 4], ["TPOT (ms)", 4],
      ["per request per iteration", 3], ["verified nodes", 1],
    ];
    var cols = ["since start", "last " + num(v.rolling_window_s, 0) + " s (n)",
      "p50", "p95", "p99", "target", "p50", "p95", "p99", "target",
      "tree nodes", "accepted tokens", "share of B", "share"];
    var h1 = el("tr"), h2 = el("tr");
    groups.forEach(function (g) {
      var th = el("th", { colspan: String(g[1]) }, g[0]);
      if (g[2]) th.setAttribute("rowspan", String(g[2]));
      if (g[0] === "class") th.className = "name";
      h1.appendChild(th);
    });
    cols.forEach(function (c) { h2.appendChild(el("th", {}, c)); });
    t.appendChild(h1);
    t.appendChild(h2);
    (v.classes || []).forEach(function (c) {
      var tr = el("tr", { "data-class": c.name });
      cell(tr, "name", c.name, c.name, "name");
      cell(tr, "requests", c.requests, num(c.requests, 0));
      cell(tr, "attainment", c.attainment, pct(c.attainment));
      var r = c.rolling || {};
      cell(tr, "rolling.attainment", r.attainment, pct(r.attainment) + " (" + num(r.requests, 0) + ")");
      ["ttft_ms", "tpot_ms"].forEach(function (k) {
        var target = (c.targets || {})[k];
        ["p50", "p95", "p99"].forEach(function (p) {
          var x = (c[k] || {})[p];
          var mark = x === null || x === undefined || target == null ? "" : (x <= target ? "meet" : "miss");
          cell(tr, k + "." + p, x, num(x, 1), mark);
        });
        cell(tr, "targets." + k, target, num(target, 1));
      });
      var rc = c.recent || {};
      cell(tr, "recent.tree_per_req", rc.tree_per_req, num(rc.tree_per_req, 2));
      cell(tr, "recent.accepted_per_req", rc.accepted_per_req, num(rc.accepted_per_req, 2));
      cell(tr, "recent.budget_share", rc.budget_share, pct(rc.budget_share));
      var vs = (c.verification || {}).share;
      cell(tr, "verification.share", vs, pct(vs));
      t.appendChild(tr);
    });
    var e = v.engine || {}, pr = e.profile || {}, th = e.threads || {}, dr = e.drift || {};
    var from = e.unloaded_tpot_ms === null || e.unloaded_tpot_ms === undefined ? "" :
      " Targets: multiples of the unloaded TPOT " + num(e.unloaded_tpot_ms, 2) + " ms, from " +
      (pr.targets_from || "the profile") + (pr.profile ? " (profile " + pr.profile +
      (pr.measured ? ", measured " + pr.measured : "") + ")" : "") + "." +
      (th.threads ? " Forward passes: " + th.threads + " thread(s), " + th.source + "." : "") +
      (dr.median_ratio !== null && dr.median_ratio !== undefined ? " Passes run at " +
      num(dr.median_ratio, 2) + "x the profile" + (dr.drifted ? " (drifted: run `adaserve profile`)" : "") + "." : "");
    var stalls = Object.keys(e.stalls || {}).map(function (k) { return k + " " + e.stalls[k]; });
    var so = e.structured || {};
    $("structured-note").textContent = so.grammars_compiled || so.masks ?
      "Structured outputs (" + so.backend + "): " + so.grammars_compiled + " grammar(s) compiled, " +
      num(so.compile_ms_mean, 2) + " ms mean, " + num(so.compile_ms_max, 2) + " ms max, " +
      so.cache_hits + " cache hit(s); " + so.masks + " node masks at " + num(so.mask_us_per_node, 1) +
      " \u00b5s each; forced tokens " + so.forced_accepted + " accepted of " + so.forced_tokens + "." :
      "Structured outputs: none served yet.";
    var pc = e.prefix_cache || {}, pcc = pc.by_class || {};
    $("prefix-note").textContent = !pc.enabled ? "Prefix caching: off." :
      "Prefix caching: " + pc.cached_tokens + " of " + pc.queried_tokens + " prompt tokens cached (" +
      num(100 * (pc.hit_rate || 0), 1) + "%)" + (Object.keys(pcc).length ? "; by class: " +
      Object.keys(pcc).map(function (k) {
        return k + " " + num(100 * (pcc[k].hit_rate || 0), 1) + "% (" + pcc[k].cached_tokens +
          " cached, " + pcc[k].computed_tokens + " computed)";
      }).join(", ") : "") + "; " + pc.cached_blocks + " blocks cached, " + pc.evictions + " evicted.";
    var ad = e.admission || {};
    var adParts = Object.keys(ad).map(function (k) {
      var a = ad[k], r = a.refused || {}, s = k + ":";
      if (a.promised_n) {
        s += " " + a.promised_n + " admitted under load, predicted to meet the SLO " +
          pct(a.predicted_attainment) + ", met " + pct(a.realised_attainment);
      }
      var rk = Object.keys(r);
      if (rk.length) s += (a.promised_n ? ";" : "") + " refused " + rk.map(function (x) { return x + " " + r[x]; }).join(", ");
      return s;
    });
    $("admission-note").textContent = adParts.length ? "Admission: " + adParts.join("; ") + "." :
      "Admission: nothing refused or promised yet.";
    $("classes-note").textContent =
      "Percentiles and attainment: finished requests since start (\u2713 meets / \u2717 misses the class target). " +
      "Per-iteration columns: means over the last " + v.recent_iterations + " iterations." + from +
      (stalls.length ? " Passes over 3x their prediction: " + stalls.join(", ") + "." : "");
  }

  function renderCounts(id, counts, label) {
    var t = $(id);
    t.textContent = "";
    var head = el("tr");
    head.appendChild(el("th", { "class": "name" }, label));
    head.appendChild(el("th", {}, "count"));
    t.appendChild(head);
    var keys = Object.keys(counts || {}).sort();
    if (!keys.length) {
      var tr = el("tr");
      tr.appendChild(el("td", { "class": "name", colspan: "2" }, "none"));
      t.appendChild(tr);
    }
    keys.forEach(function (k) {
      var tr = el("tr", { "data-reason": k });
      cell(tr, "reason", k, k, "name");
      cell(tr, "count", counts[k], num(counts[k], 0));
      t.appendChild(tr);
    });
  }

  function renderTenants(v) {
    var t = $("tenants");
    t.textContent = "";
    var cols = [["requests", 0], ["prompt_tokens", 0], ["completion_tokens", 0], ["charge", 4], ["rate_limited", 0]];
    var head = el("tr");
    head.appendChild(el("th", { "class": "name" }, "tenant"));
    ["requests", "prompt tokens", "output tokens", "charge", "rate limited (429)"].forEach(function (h) {
      head.appendChild(el("th", {}, h));
    });
    t.appendChild(head);
    var names = Object.keys(v.tenants || {}).sort();
    names.forEach(function (n) {
      var u = v.tenants[n];
      var tr = el("tr", { "data-tenant": n });
      cell(tr, "name", n, n, "name");
      cols.forEach(function (c) { cell(tr, c[0], u[c[0]], num(u[c[0]], c[1])); });
      t.appendChild(tr);
    });
    if (!names.length) {
      var tr = el("tr");
      tr.appendChild(el("td", { "class": "name", colspan: String(cols.length + 1) }, "no usage yet"));
      t.appendChild(tr);
    }
  }

  // a service of replicas (the scale-out front door): one row each; the charts show
  // the timeline of the replica chosen in #replica
  function renderReplicas(v) {
    var reps = v.replicas || null;
    $("replicas-box").hidden = !reps;
    var sel = $("replica");
    $("replica-pick").hidden = !reps;
    if (!reps) return;
    var ids = Object.keys(reps).sort();
    var keep = sel.value;
    sel.textContent = "";
    ids.forEach(function (id) {
      sel.appendChild(el("option", { value: id }, "replica " + id + (reps[id].live ? "" : " (gone)")));
    });
    if (ids.indexOf(keep) >= 0) sel.value = keep;
    else if (v.timeline_replica && ids.indexOf(v.timeline_replica) >= 0) sel.value = v.timeline_replica;
    var t = $("replicas");
    t.textContent = "";
    var head = el("tr");
    head.appendChild(el("th", { "class": "name" }, "replica"));
    ["live", "running", "waiting", "KV used", "iterations"].forEach(function (h) { head.appendChild(el("th", {}, h)); });
    t.appendChild(head);
    ids.forEach(function (id) {
      var r = reps[id];
      var tr = el("tr", { "data-replica": id });
      cell(tr, "name", id, id, "name");
      cell(tr, "live", r.live, r.live ? "yes" : "no");
      cell(tr, "running", r.running, num(r.running, 0));
      cell(tr, "waiting", r.waiting, num(r.waiting, 0));
      cell(tr, "kv_usage", r.kv_usage, pct(r.kv_usage));
      cell(tr, "iterations", r.iterations, num(r.iterations, 0));
      t.appendChild(tr);
    });
  }

  function timelineOf(v) {
    var reps = v.replicas, id = $("replica").value;
    if (reps && reps[id] && reps[id].timeline) return reps[id].timeline;
    return v.timeline || {};
  }

  // ------------------------------------------------------------------ charts
  function width(id) { return Math.max(300, $(id).clientWidth || 400); }

  function chart(id, key, opts, data) {
    var have = charts[id];
    if (have && have.key === key) {
      have.u.setData(data);
      return;
    }
    if (have) have.u.destroy();
    $(id).textContent = "";
    opts.width = width(id);
    opts.height = 220;
    charts[id] = { key: key, u: new uPlot(opts, data, $(id)) };
  }

  function empty(id, why) {
    if (charts[id]) { charts[id].u.destroy(); delete charts[id]; }
    $(id).textContent = "";
    $(id).appendChild(el("div", { "class": "empty" }, why));
  }

  function line(label, i, scale) {
    return { label: label, stroke: PALETTE[i % PALETTE.length], dash: DASHES[i % DASHES.length],
             width: 2, scale: scale || "y", spanGaps: false, points: { show: false } };
  }

  function timeChart(id, t, series, yLabel, extraAxes) {
    if (!t.length) { empty(id, "no iterations yet"); return; }
    var axes = [{ label: "time since start (s)" }, { label: yLabel, size: 60 }].concat(extraAxes || []);
    var opts = { scales: { x: { time: false } }, axes: axes, legend: { live: false },
                 series: [{ label: "time (s)" }].concat(series.map(function (s) { return s.spec; })) };
    var key = series.map(function (s) { return s.spec.label; }).join("|");
    chart(id, key, opts, [t].concat(series.map(function (s) { return s.data; })));
  }

  function scaled(a, f) { return a.map(function (x) { return x === null || x === undefined ? null : f * x; }); }

  // categories on x: bars for one series, markers (no lines) for several
  function catChart(id, labels, series, yLabel, xLabel, bars) {
    if (!labels.length) { empty(id, "no data yet"); return; }
    var xs = labels.map(function (_, i) { return i; });
    var opts = {
      legend: { live: false },
      scales: { x: { time: false, range: function () { return [-0.5, labels.length - 0.5]; } },
                y: { range: function (u, lo, hi) { return [0, Math.max(hi || 0, 1) * 1.1]; } } },
      axes: [
        { label: xLabel, splits: function () { return xs; },
          values: function (u, splits) { return splits.map(function (i) { return labels[i] === undefined ? "" : labels[i]; }); } },
        { label: yLabel, size: 60 },
      ],
      series: [{ label: xLabel }].concat(series.map(function (s, i) {
        var c = PALETTE[i % PALETTE.length];
        return bars
          ? { label: s.label, stroke: c, fill: c, width: 1, paths: uPlot.paths.bars({ size: [0.6, 80] }), points: { show: false } }
          : { label: s.label, stroke: c, fill: c, width: 0, paths: function () { return null; },
              points: { show: true, size: 12 - 3 * i, stroke: c, fill: i ? "#fff" : c, width: 2 } };
      })),
    };
    var key = labels.join("|") + "#" + series.map(function (s) { return s.label; }).join("|");
    chart(id, key, opts, [xs].concat(series.map(function (s) { return s.data; })));
  }

  function renderCharts(v) {
    var tl = timelineOf(v);
    var t = tl.t || [];
    var names = (v.classes || []).map(function (c) { return c.name; });
    timeChart("c-queue", t, [
      { spec: line("running", 0), data: tl.running || [] },
      { spec: line("waiting", 1), data: tl.waiting || [] },
    ], "requests");
    timeChart("c-kv", t, [{ spec: line("KV used (%)", 0), data: scaled(tl.kv_usage || [], 100) }], "% of KV pool");
    timeChart("c-budget", t, [
      { spec: line("budget B (tokens)", 0), data: tl.budget || [] },
      { spec: line("tokens verified", 2), data: tl.tokens || [] },
      { spec: line("max tree depth", 1, "depth"), data: tl.depth || [] },
    ], "tokens / iteration", [{ scale: "depth", side: 1, label: "depth (tokens)", grid: { show: false }, size: 50 }]);
    ["tree_per_req", "accepted_per_req", "budget_share"].forEach(function (k, j) {
      var id = ["c-tree", "c-acc", "c-share"][j];
      var f = k === "budget_share" ? 100 : 1;
      var unit = ["nodes / request", "tokens / request", "% of budget B"][j];
      timeChart(id, t, names.map(function (n, i) {
        return { spec: line(n, i), data: scaled(((tl[k] || {})[n]) || [], f) };
      }), unit);
    });
    var pos = v.acceptance_by_position || [];
    catChart("c-pos", pos.map(function (p) { return String(p.position + 1); }),
             [{ label: "accepted (%)", data: pos.map(function (p) { return p.rate === null ? null : 100 * p.rate; }) }],
             "% of drafts", "position in path (1 = first draft token)", true);
    var lat = ["ttft_ms", "tpot_ms"].map(function (k) {
      return { label: (k === "ttft_ms" ? "TTFT" : "TPOT") + " p99 / target",
               data: (v.classes || []).map(function (c) {
                 var x = (c[k] || {}).p99, tg = (c.targets || {})[k];
                 return x === null || x === undefined || !tg ? null : x / tg;
               }) };
    });
    catChart("c-lat", names, lat, "p99 / target (ratio)", "SLO class (\u2264 1 meets)", false);
  }

  function render(v) {
    $("meta").textContent = [v.model ? "model " + v.model : null, v.policy ? "policy " + v.policy : null,
      "at " + num(v.as_of_s, 1) + " s"].filter(Boolean).join(" \u00b7 ");
    lastView = v;
    renderOverall(v);
    renderClasses(v);
    renderReplicas(v);
    renderCharts(v);
    renderCounts("shed", v.shed, "reason");
    renderCounts("fallback", v.fallback_iterations, "reason");
    renderTenants(v);
    document.body.setAttribute("data-as-of", String(v.as_of_s));
  }

  function clearData() {
    for (var id in charts) charts[id].u.destroy();
    charts = {};
    lastView = null;
    ["overall", "classes", "shed", "fallback", "tenants", "replicas", "meta", "classes-note"].forEach(function (id) { $(id).textContent = ""; });
    document.querySelectorAll(".charts figure > div").forEach(function (d) { d.textContent = ""; });
    $("main").hidden = true;
  }

  // ------------------------------------------------------------------ live mode
  function status(text, bad) { var s = $("status"); s.textContent = text; s.className = bad ? "bad" : ""; }

  function errorOf(body, code) {
    return body && body.error && body.error.message ? body.error.message : "HTTP " + code;
  }

  function send(method, headers) {
    return fetch(BOOT.session_url, { method: method, headers: headers || {}, cache: "no-store",
                                     credentials: "same-origin" })
      .then(function (r) {
        if (r.status === 204) return [204, {}];
        return r.json().catch(function () { return {}; }).then(function (body) { return [r.status, body]; });
      });
  }

  function poll() {
    fetch(BOOT.data_url, { headers: { Accept: "application/json" }, cache: "no-store",
                           credentials: "same-origin" })
      .then(function (r) {
        return r.json().catch(function () { return {}; }).then(function (body) { return [r.status, body]; });
      })
      .then(function (res) {
        var code = res[0], body = res[1];
        if (code === 401 || code === 403) {
          // the session ended (expired, signed out elsewhere): the server's page says why
          clearData();
          status("signed out", true);
          location.reload();
          return;
        }
        if (code !== 200) { status("HTTP " + code + "; retrying", true); schedule(); return; }
        $("main").hidden = false;
        render(body);
        status("live, updated " + new Date().toLocaleTimeString(), false);
        schedule();
      })
      .catch(function () { status("server unreachable; retrying", true); schedule(); });
  }

  function schedule() { clearTimeout(timer); timer = setTimeout(poll, BOOT.interval_ms || 1000); }

  function live() {
    $("signout").hidden = !BOOT.session;
    $("signout").addEventListener("click", function () {
      clearTimeout(timer);
      clearData();
      status("signing out", false);
      send("DELETE").then(function () { location.reload(); }, function () { location.reload(); });
    });
    $("replica").addEventListener("change", function () { if (lastView) renderCharts(lastView); });
    poll();
  }

  function signin() {
    $("login").hidden = false;
    $("login-msg").textContent = BOOT.message || "";
    status("signed out", true);
    $("login").addEventListener("submit", function (ev) {
      ev.preventDefault();
      var key = $("key").value.trim();
      $("key").value = "";
      $("login-msg").textContent = "";
      status("signing in", false);
      send("POST", { Authorization: "Bearer " + key })
        .then(function (res) {
          var code = res[0];
          if (code === 204) { location.reload(); return; }
          $("login-msg").textContent = (code === 403 ? "This key is not an admin key: " : "") + errorOf(res[1], code);
          status("signed out", true);
        })
        .catch(function () { $("login-msg").textContent = "server unreachable"; status("signed out", true); });
    });
  }

  // ------------------------------------------------------------------ static mode
  function offline() {
    var runs = BOOT.runs || [];
    var sel = $("run");
    runs.forEach(function (v, i) { sel.appendChild(el("option", { value: String(i) }, v.title || ("run " + i))); });
    sel.hidden = runs.length < 2;
    sel.addEventListener("change", function () { clearData(); $("main").hidden = false; render(runs[+sel.value]); });
    status("static report", false);
    if (runs.length) { $("main").hidden = false; render(runs[0]); }
  }

  window.addEventListener("resize", function () {
    for (var id in charts) charts[id].u.setSize({ width: width(id), height: 220 });
  });
  if (BOOT.mode === "live") live(); else if (BOOT.mode === "signin") signin(); else offline();
})();
