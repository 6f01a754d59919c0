// relaybox console: one page over the console's JSON API. Every URL is relative (the
// console may be mounted under any prefix), and every value from the API reaches the
// page as text (textContent), never as HTML: message content is hostile.
"use strict";

const STATES = ["pending", "delayed", "retrying", "in_flight", "held", "abandoned", "published"];
const TEXT_FIELDS = ["target", "topic", "key", "type", "id", "correlation_id", "causation_id",
  "tenant_id", "aggregate_id", "min_seq", "max_seq", "since", "until"];
const ACTIONS = ["replay", "discard", "delay", "expedite", "hold", "release"];
// Statuses of the table's counts -> the search's state for them.
const STATUS_STATE = { pending: "pending", processing: "in_flight", failed: "retrying",
  abandoned: "abandoned", published: "published" };

let session = { changes: false, signed_in: false, csrf: null, read_only_reason: null, host_user: null, token_sign_in: true };
// Timers of the page shown (the overview's refresh, a backfill's progress): a new page
// stops them.
let timers = [];
// Counts the pages shown, so that an answer for a page left since is dropped.
let shownPage = 0;
const REFRESH_MS = 10000;
const SVG = "http://www.w3.org/2000/svg";

function every(ms, work) {
  timers.push(setInterval(work, ms));
}

function stopTimers() {
  for (const timer of timers) clearInterval(timer);
  timers = [];
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function shown(value) {
  return value === null || value === undefined ? "—" : String(value);
}

async function api(path, options) {
  const response = await fetch(path, { credentials: "same-origin", ...(options || {}) });
  let body = null;
  try { body = await response.json(); } catch (_) { body = null; }
  if (!response.ok) {
    throw new Error(body && body.error ? body.error : `${response.status} ${response.statusText}`);
  }
  return body;
}

function post(path, body) {
  return api(path, {
    method: "POST",
    headers: { "Content-Type": "application/json", "X-CSRF-Token": session.csrf || "" },
    body: JSON.stringify(body),
  });
}

function errorBox(error) {
  return el("p", { class: "error", role: "alert" }, error.message || String(error));
}

function show(...nodes) {
  document.getElementById("main").replaceChildren(...nodes.filter((node) => node !== null));
}

function stateBadge(state) {
  return el("span", { class: `state state-${state}` }, state);
}

function messageLink(table, row) {
  return el("a", { href: `#/t/${table}/m/${row.seq}` }, `#${row.seq}`);
}

function keyName(target, key) {
  return `${target}/${key === null ? "(no key)" : key}`;
}

function fieldTable(pairs) {
  return el("table", { class: "fields" },
    pairs.map(([name, value]) => el("tr", {}, el("th", {}, name), el("td", {}, shown(value)))));
}

// -- who may change ------------------------------------------------------------------

async function loadSession() {
  session = await api("api/session");
  renderWho();
}

function renderWho() {
  const who = document.getElementById("who");
  if (!session.changes) {
    who.replaceChildren(el("span", { class: "read-only" }, `Read-only: ${session.read_only_reason}`));
  } else if (session.host_user !== null) {
    who.replaceChildren(el("span", { id: "host-user" }, `Signed in as ${session.host_user}`));
  } else if (!session.token_sign_in) {
    who.replaceChildren(el("span", { id: "host-user" }, "Not signed in to the application"));
  } else if (session.signed_in) {
    who.replaceChildren(el("span", {}, "Signed in "),
      el("button", { type: "button", onclick: signOut }, "Sign out"));
  } else {
    const input = el("input", { type: "password", name: "token", placeholder: "console token",
      autocomplete: "current-password", "aria-label": "console token" });
    who.replaceChildren(el("form", { id: "sign-in", onsubmit: (event) => signIn(event, input) },
      input, el("button", { type: "submit" }, "Sign in")));
  }
}

async function signIn(event, input) {
  event.preventDefault();
  try {
    await post("api/login", { token: input.value });
    input.value = "";
    await loadSession();
    route();
  } catch (error) {
    document.getElementById("who").append(errorBox(error));
  }
}

async function signOut() {
  await post("api/logout", {});
  await loadSession();
  route();
}

// -- charts --------------------------------------------------------------------------

function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value !== null && value !== undefined) node.setAttribute(name, String(value));
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const CHART = { width: 360, height: 90, top: 14, bottom: 14 };

function minuteOf(iso) {
  return iso.slice(11, 16);
}

function niceMax(value) {
  return value > 0 ? value : 1;
}

function seconds(value) {
  if (value === null || value === undefined) return "—";
  return value < 10 ? `${value.toFixed(2)} s` : `${value.toFixed(1)} s`;
}

// The frame of a chart over `points` (one a minute): the largest value at the top,
// the first and last minute under it.
function chartFrame(kind, label, points, top, plot) {
  const { width, height } = CHART;
  return svg("svg", { class: `chart chart-${kind}`, viewBox: `0 0 ${width} ${height}`,
    width, height, role: "img", "aria-label": label },
  svg("title", {}, label),
  svg("line", { class: "axis", x1: 0, y1: height - CHART.bottom, x2: width, y2: height - CHART.bottom }),
  svg("text", { class: "scale", x: 2, y: 10 }, top),
  points.length ? svg("text", { class: "scale", x: 2, y: height - 2 }, minuteOf(points[0].minute)) : null,
  points.length ? svg("text", { class: "scale", x: width - 2, y: height - 2, "text-anchor": "end" },
    `${minuteOf(points[points.length - 1].minute)} UTC`) : null,
  ...plot);
}

// Bars, one a minute, of `field`.
function barChart(kind, label, points, field) {
  const { width, height, top, bottom } = CHART;
  const largest = niceMax(Math.max(0, ...points.map((p) => p[field])));
  const step = width / Math.max(points.length, 1);
  const span = height - top - bottom;
  const bars = points.map((p, i) => {
    const tall = (p[field] / largest) * span;
    return svg("rect", { class: "bar", "data-count": p[field], x: (i * step + 0.5).toFixed(1),
      y: (height - bottom - tall).toFixed(1), width: Math.max(step - 1, 1).toFixed(1), height: tall.toFixed(1) },
    svg("title", {}, `${minuteOf(p.minute)}: ${p[field]}`));
  });
  return chartFrame(kind, label, points, `${largest} / min`, bars);
}

// Lines of each (field, class) in `lines`; a minute without a value breaks its line.
function lineChart(kind, label, points, lines) {
  const { width, height, top, bottom } = CHART;
  const values = points.flatMap((p) => lines.map(([field]) => p[field])).filter((v) => v !== null);
  const largest = values.length ? Math.max(...values) : 0;
  const scale = largest > 0 ? largest : 1;
  const step = width / Math.max(points.length, 1);
  const span = height - top - bottom;
  const plot = [];
  for (const [field, cls] of lines) {
    let run = [];
    const flush = () => {
      if (run.length === 1) plot.push(svg("circle", { class: cls, cx: run[0][0], cy: run[0][1], r: 2 }));
      else if (run.length) plot.push(svg("polyline", { class: cls, points: run.map((xy) => xy.join(",")).join(" ") }));
      run = [];
    };
    points.forEach((p, i) => {
      if (p[field] === null) { flush(); return; }
      run.push([(i * step + step / 2).toFixed(1), (height - bottom - (p[field] / scale) * span).toFixed(1)]);
    });
    flush();
  }
  return chartFrame(kind, label, points, largest > 0 ? seconds(largest) : "no lag", plot);
}

function legend(...items) {
  return el("p", { class: "legend" }, items.map(([cls, text]) => el("span", { class: cls }, text)));
}

function sum(points, field) {
  return points.reduce((total, p) => total + p[field], 0);
}

// -- overview ------------------------------------------------------------------------

async function overview() {
  const page = shownPage;
  const { tables } = await api("api/tables");
  const activities = await Promise.all(tables.map((t) => api(`api/tables/${t.index}/activity?minutes=60`)));
  const { inboxes } = await api("api/inboxes");
  const watched = await Promise.all(inboxes.map((inbox) => api(`api/inboxes/${inbox.index}/activity?minutes=60`)
    .catch((error) => ({ ...inbox, error }))));
  if (page !== shownPage) return;
  show(...tables.map((table, n) => tableSection(table, activities[n])),
    watched.length ? consumersSection(watched) : null,
    el("p", { class: "note", id: "refreshed" }, `Refreshed at ${new Date().toISOString().slice(11, 19)} UTC; every 10 s while shown.`));
}

function tableSection(table, activity) {
  const counts = Object.entries(table.counts).map(([status, count]) => {
    const state = STATUS_STATE[status];
    const cell = state && count ? el("a", { href: `#/t/${table.index}/search?state=${state}` }, count) : count;
    return el("tr", {}, el("th", {}, status), el("td", {}, cell));
  });
  const search = (fields) => `#/t/${table.index}/search?${new URLSearchParams(fields)}`;
  const count = (n, fields) => (n ? el("a", { href: search(fields) }, n) : "0");
  const targets = Object.entries(table.targets).map(([target, t]) => el("tr", { "data-target": target },
    el("th", {}, el("a", { href: search({ target }) }, target)),
    el("td", {}, t.live),
    ["retrying", "held", "abandoned"].map((state) => el("td", {}, count(t[state], { target, state }))),
    el("td", {}, shown(t.stuck_since))));
  const targetHead = el("tr", {}, ["target", "to deliver", "retrying", "held", "abandoned",
    "oldest stuck written"].map((name) => el("th", {}, name)));
  return el("section", { class: "table" },
    el("h2", {}, table.name),
    el("p", { class: "links" },
      el("a", { href: `#/t/${table.index}/search` }, "Search"),
      el("a", { href: `#/t/${table.index}/search?state=abandoned` }, "Abandoned"),
      el("a", { href: `#/t/${table.index}/search?state=held` }, "Held"),
      el("a", { href: `#/t/${table.index}/audit` }, "Audit"),
      el("a", { href: `#/t/${table.index}/backfill` }, "Backfill")),
    el("h3", {}, "Messages by status"), el("table", { class: "counts" }, counts,
      el("tr", {}, el("th", {}, "held (of the above)"), el("td", {}, count(table.held, { state: "held" })))),
    el("h3", {}, "By target: still to deliver, and stuck"),
    targets.length ? el("table", { class: "targets" }, targetHead, targets) : el("p", { class: "note" }, "Nothing."),
    el("p", { class: "note", id: "oldest-pending" },
      `Oldest due message waits: ${table.oldest_pending_age === null ? "—" : `${table.oldest_pending_age.toFixed(1)} s`}; `
      + `leases held: ${table.active_leases}`),
    deliveries(activity),
    el("h3", {}, "Live relays"),
    table.relays.length
      ? el("table", { class: "relays" },
        el("tr", {}, ["relay", "target", "partitions held", "since", "lease until"].map((n) => el("th", {}, n))),
        table.relays.map((r) => el("tr", {}, el("td", {}, r.worker), el("td", {}, r.target),
          el("td", { title: r.partitions.join(", ") }, r.partitions.length), el("td", {}, r.joined_at),
          el("td", {}, r.lease_until))))
      : el("p", { class: "note" }, "None (or relays that lease rows, not partitions)."));
}

// Per target, the last hour's deliveries and each live relay's circuit.
function deliveries(activity) {
  const names = [...new Set([...Object.keys(activity.targets), ...activity.statuses.map((s) => s.target)])].sort();
  const parts = [el("h3", {}, `Deliveries, last ${activity.minutes} minutes`)];
  if (!names.length) {
    parts.push(el("p", { class: "note" }, "No relay has written its activity in this window."));
  }
  for (const target of names) {
    const points = activity.targets[target] || [];
    const statuses = activity.statuses.filter((s) => s.target === target);
    parts.push(el("div", { class: "watch", "data-target": target },
      el("h4", {}, target),
      el("p", { class: "totals" }, `published ${sum(points, "published")}, failed ${sum(points, "failed")}, `
        + `abandoned ${sum(points, "abandoned")}`),
      el("div", { class: "charts" },
        el("figure", {}, barChart("published", `${target}: messages published per minute`, points, "published"),
          el("figcaption", {}, "Published per minute")),
        el("figure", {}, lineChart("lag", `${target}: delivery lag per minute`, points,
          [["lag_max_seconds", "lag-max"], ["lag_avg_seconds", "lag-avg"]]),
        el("figcaption", {}, "Delivery lag: ", legend(["lag-max", "max"], ["lag-avg", "average"])))),
      statuses.length
        ? el("ul", { class: "circuits" }, statuses.map((s) => el("li", { "data-worker": s.worker },
          `${s.worker}: circuit `, el("span", { class: `circuit circuit-${s.circuit}` }, s.circuit),
          ` (as of ${s.updated_at})`,
          s.last_error === null ? null : el("div", { class: "last-error" }, `last error: ${s.last_error}`))))
        : el("p", { class: "note" }, "No live relay reports this target.")));
  }
  return el("div", { class: "deliveries" }, parts);
}

function consumersSection(watched) {
  return el("section", { class: "table consumers" }, el("h2", {}, "Consumers"),
    watched.map((inbox) => {
      if (inbox.error) return el("div", { class: "inbox" }, el("h3", {}, inbox.name), errorBox(inbox.error));
      const names = [...new Set([...Object.keys(inbox.consumers), ...Object.keys(inbox.parked_now)])].sort();
      const head = el("tr", {}, ["consumer", "applied", "duplicate", "parked", "parked now",
        `commit-to-applied lag, last ${inbox.minutes} minutes`].map((n) => el("th", {}, n)));
      const rows = names.map((name) => {
        const points = inbox.consumers[name] || [];
        return el("tr", { "data-consumer": name }, el("th", {}, name),
          el("td", { class: "applied" }, sum(points, "applied")), el("td", {}, sum(points, "duplicate")),
          el("td", {}, sum(points, "parked")), el("td", { class: "parked-now" }, inbox.parked_now[name] || 0),
          el("td", {}, lineChart("consumer-lag", `${name}: lag from a message's time to applied`, points,
            [["lag_max_seconds", "lag-max"], ["lag_avg_seconds", "lag-avg"]])));
      });
      return el("div", { class: "inbox", "data-inbox": inbox.index },
        el("h3", {}, inbox.name),
        names.length ? el("table", { class: "consumers" }, head, rows)
          : el("p", { class: "note" }, "No consumer has written its activity in this window."),
        el("p", { class: "note" }, `Counts over the last ${inbox.minutes} minutes; `,
          legend(["lag-max", "max"], ["lag-avg", "average"]), " lag per minute."));
    }));
}

// -- search --------------------------------------------------------------------------

function searchForm(table, params) {
  const states = params.getAll("state");
  const boxes = STATES.map((state) => el("label", { class: "check" },
    el("input", { type: "checkbox", name: "state", value: state, checked: states.includes(state) }), ` ${state} `));
  const fields = TEXT_FIELDS.map((name) => el("label", {}, name,
    el("input", { name, value: params.get(name) || "",
      placeholder: name === "since" || name === "until" ? "2024-05-01T12:00:00Z" : "" })));
  const order = el("select", { name: "order" },
    ["newest", "oldest"].map((o) => el("option", { value: o, selected: params.get("order") === o }, o)));
  const form = el("form", { class: "search", id: "search-form" },
    el("fieldset", {}, el("legend", {}, "state"), boxes), fields,
    el("label", {}, "order", order),
    el("label", {}, "limit", el("input", { name: "limit", value: params.get("limit") || "50" })),
    el("div", {}, el("button", { type: "submit" }, "Search")));
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const query = new URLSearchParams();
    for (const [name, value] of new FormData(form)) if (value !== "") query.append(name, value);
    location.hash = `#/t/${table}/search?${query}`;
  });
  return form;
}

function filterOf(params) {
  const filter = {};
  const states = params.getAll("state");
  if (states.length) filter.state = states;
  for (const name of TEXT_FIELDS) if (params.get(name)) filter[name] = params.get(name);
  return filter;
}

function resultTable(table, rows) {
  const head = el("tr", {}, ["seq", "state", "target", "topic", "key", "type", "attempts",
    "created", "due", "last error"].map((name) => el("th", {}, name)));
  return el("table", { class: "results" }, head, rows.map((row) => el("tr", { "data-seq": row.seq },
    el("td", {}, messageLink(table, row)), el("td", {}, stateBadge(row.state)),
    el("td", {}, row.target), el("td", {}, row.topic), el("td", {}, shown(row.key)),
    el("td", {}, row.type), el("td", {}, row.attempts), el("td", {}, row.created_at),
    el("td", {}, shown(row.available_at)), el("td", {}, shown(row.last_error)))));
}

async function search(table, params) {
  const form = searchForm(table, params);
  show(el("h2", {}, "Search"), form, el("p", {}, "Searching…"));
  const page = await api(`api/tables/${table}/messages?${params}`);
  const parts = [el("h2", {}, "Search"), form];
  if (!page.messages.length) parts.push(el("p", { class: "note" }, "No message matches."));
  else parts.push(resultTable(table, page.messages));
  if (page.next_after !== null) {
    const next = new URLSearchParams(params);
    next.set("after", page.next_after);
    parts.push(el("p", {}, el("a", { href: `#/t/${table}/search?${next}`, id: "next-page" }, "Next page")));
  }
  const filter = filterOf(params);
  if (Object.keys(filter).length) {
    parts.push(actionsPanel(table, { filter }, "every message this search matches", () => route()));
  }
  show(...parts);
}

// -- one message ---------------------------------------------------------------------

function queueList(table, title, rows, empty) {
  return [el("h3", {}, title), rows.length ? resultTable(table, rows) : el("p", { class: "note" }, empty)];
}

async function message(table, seq) {
  const m = await api(`api/tables/${table}/messages/${seq}`);
  const queue = m.queue;
  const parts = [
    el("h2", {}, `Message #${m.seq} `, stateBadge(m.state)),
    el("h3", {}, "Envelope"),
    fieldTable([["id", m.id], ["target", m.target], ["topic", m.topic], ["key", m.key],
      ["type", m.type], ["partition", m.partition], ["external", m.external],
      ["content type", m.payload.content_type], ["correlation id", m.correlation_id],
      ["causation id", m.causation_id], ["tenant id", m.tenant_id],
      ["aggregate id", m.aggregate_id], ["occurred", m.occurred_at], ["written", m.created_at]]),
    el("h3", {}, "Delivery"),
    fieldTable([["state", m.state], ["attempts", m.attempts], ["due", m.available_at],
      ["published", m.published_at], ["abandoned", m.abandoned_at],
      ["leased by", m.locked_by], ["lease until", m.locked_until]]),
    el("h3", {}, "Last error"),
    m.last_error === null ? el("p", { class: "note" }, "None.") : el("pre", { id: "last-error" }, m.last_error),
    el("h3", {}, "Headers"),
    Object.keys(m.headers).length ? fieldTable(Object.entries(m.headers)) : el("p", { class: "note" }, "None."),
    el("h3", {}, `Payload (${m.payload.kind}, ${m.payload.size} bytes${m.payload.truncated ? ", cut short" : ""})`),
    el("pre", { id: "payload" }, m.payload.text),
  ];
  if (queue === null) {
    parts.push(el("h3", {}, "Key queue"),
      el("p", { class: "note" }, "No key: it waits for nothing and holds nothing back."));
  } else {
    parts.push(
      ...queueList(table, `Waits for: live messages of ${keyName(m.target, m.key)} before it`,
        queue.ahead, "Nothing: it is first in its key's queue."),
      ...queueList(table, "Waiting behind it", queue.behind, "Nothing waits behind it."),
      queue.more_behind ? el("p", { class: "note" }, "…and more.") : null,
      ...queueList(table, "Already published after it", queue.published_after,
        "None (of those kept by the retention)."));
  }
  parts.push(actionsPanel(table, { seqs: [m.seq] }, `message #${m.seq}`, () => route()));
  show(...parts);
}

// -- actions -------------------------------------------------------------------------

function describe(outcome) {
  const n = outcome.matched;
  if (!n) return `Nothing to ${outcome.action}: no message selected is in a state it applies to.`;
  const keys = outcome.keys.map((k) => keyName(k.target, k.key));
  let text = `Will ${outcome.action} ${n} message${n === 1 ? "" : "s"} (${outcome.seqs.map((s) => `#${s}`).join(", ")})`;
  if (keys.length) text += ` of key${keys.length === 1 ? "" : "s"} ${keys.join(", ")}`;
  if (outcome.action === "replay") {
    const ahead = outcome.published_ahead.map((r) => `#${r.seq} (${keyName(r.target, r.key)})`);
    text += `; already published ahead: ${ahead.length ? ahead.join(", ") : "none"}`;
  }
  return `${text}.`;
}

// The actor of the audit records: the user the host application signed in, when it
// did (the server takes that name whatever the field says), else what the operator types.
function actorInput(attributes) {
  if (session.host_user !== null) {
    return el("input", { ...attributes, value: session.host_user, readonly: "readonly" });
  }
  return el("input", { ...attributes, value: localStorage.getItem("relaybox-actor") || "" });
}

function actionsPanel(table, selection, what, done) {
  if (!session.changes) return null;
  if (!session.signed_in) {
    const how = session.token_sign_in ? "Sign in" : "Sign in to the application";
    return el("section", { class: "actions" }, el("p", { class: "note" }, `${how} to act on messages.`));
  }
  const actor = actorInput({ name: "actor", id: "actor" });
  const reason = el("input", { name: "reason", id: "reason", size: 40 });
  const delay = el("input", { name: "delay", id: "delay", value: "60", size: 6 });
  const outcome = el("div", { id: "outcome" });
  const body = (action, dryRun) => ({ ...selection, dry_run: dryRun, actor: actor.value,
    reason: reason.value || null, ...(action === "delay" ? { delay: Number(delay.value) } : {}) });
  const ask = async (action) => {
    localStorage.setItem("relaybox-actor", actor.value);
    outcome.replaceChildren();
    try {
      const preview = await post(`api/tables/${table}/actions/${action}`, body(action, true));
      const confirm = el("button", { type: "button", id: "confirm", onclick: async () => {
        try {
          const result = await post(`api/tables/${table}/actions/${action}`, body(action, false));
          outcome.replaceChildren(el("p", { class: "done", id: "done" },
            `Done: ${action} changed ${result.changed} of ${result.matched} message${result.matched === 1 ? "" : "s"}.`,
            " ", el("button", { type: "button", onclick: done }, "Reload")));
        } catch (error) { outcome.replaceChildren(errorBox(error)); }
      } }, `Confirm ${action}`);
      const cancel = el("button", { type: "button", onclick: () => outcome.replaceChildren() }, "Cancel");
      outcome.replaceChildren(el("div", { class: "preview", id: "preview" },
        el("p", {}, describe(preview)), preview.matched ? confirm : null, cancel));
    } catch (error) { outcome.replaceChildren(errorBox(error)); }
  };
  return el("section", { class: "actions" },
    el("h3", {}, `Act on ${what}`),
    el("p", {}, el("label", {}, "Actor ", actor), " ", el("label", {}, "Reason ", reason), " ",
      el("label", {}, "Delay (s) ", delay)),
    el("p", {}, ACTIONS.map((action) => el("button", { type: "button", "data-action": action,
      onclick: () => ask(action) }, action[0].toUpperCase() + action.slice(1)))),
    el("p", { class: "note" }, "Each action shows what it would change first; nothing changes until you confirm."),
    outcome);
}

// -- backfill ------------------------------------------------------------------------

const BACKFILL_FILTERS = ["since", "until", "min_seq", "max_seq", "topic", "key", "type"];

function backfillForm(table) {
  const field = (name, label, attrs) => el("label", {}, label, el("input", { name, id: `bf-${name}`, ...(attrs || {}) }));
  return el("form", { class: "search", id: "backfill-form" },
    field("name", "job name", { required: true }),
    field("source", "from target (its published messages)", { required: true }),
    BACKFILL_FILTERS.map((name) => field(name, name,
      { placeholder: name === "since" || name === "until" ? "2024-05-01T12:00:00Z" : "" })),
    field("to", "to target", { required: true }),
    el("label", { class: "check" }, el("input", { type: "checkbox", name: "external", id: "bf-external" }), " external target"),
    field("rate", "at most, per second", { placeholder: "no limit" }),
    field("actor", "actor", session.host_user !== null
      ? { value: session.host_user, readonly: "readonly" }
      : { value: localStorage.getItem("relaybox-actor") || "" }),
    field("reason", "reason"),
    el("div", {}, el("button", { type: "submit", id: "bf-dry-run" }, "Dry run")));
}

function backfillBody(form, dryRun) {
  const values = Object.fromEntries(new FormData(form));
  const filter = { target: values.source };
  for (const name of BACKFILL_FILTERS) if (values[name]) filter[name] = values[name];
  return { name: values.name, filter, to: values.to, external: values.external === "on",
    rate: values.rate ? Number(values.rate) : null, actor: values.actor,
    reason: values.reason || null, dry_run: dryRun };
}

function describePlan(answer, to) {
  const { count, keys, keys_live_on_target: live } = answer.plan;
  const parts = [el("p", {}, `Will copy ${count} message${count === 1 ? "" : "s"} of ${keys} key${keys === 1 ? "" : "s"} to ${to}.`)];
  if (answer.job) {
    parts.push(el("p", { class: "note" }, `This job exists: ${answer.job.copied} copied so far, up to seq `
      + `${answer.job.cursor}; it goes on from there.`));
  }
  parts.push(live.length
    ? el("div", {}, el("p", {}, `Keys with messages live on ${to} now (their copies go out after those): `),
      el("ul", { id: "live-keys" }, live.map((key) => el("li", {}, key))))
    : el("p", {}, `No key has messages live on ${to} now.`));
  return parts;
}

// Where the job stands, read again every second while it runs.
function followBackfill(table, name, total, into) {
  const render = async () => {
    let status;
    try { status = await api(`api/tables/${table}/backfills/${encodeURIComponent(name)}`); } catch (error) {
      into.replaceChildren(errorBox(error));
      return false;
    }
    const job = status.job;
    const copied = job ? job.copied : 0;
    const state = status.running ? "running" : job && job.finished ? "finished" : "stopped";
    into.replaceChildren(el("div", { class: state === "finished" ? "done" : "preview", id: "backfill-status",
      "data-state": state },
    el("p", {}, `Backfill ${name}: ${state}; ${copied} copied${total === null ? "" : ` of ${total}`}`
      + (job ? `, up to seq ${job.cursor}` : "") + "."),
    total ? el("progress", { max: total, value: Math.min(copied, total) }) : null,
    job ? el("p", { class: "note" }, `${job.source_target} → ${job.to}${job.external ? " (external)" : ""}, `
      + `by ${job.actor}${job.reason ? `: ${job.reason}` : ""}; started ${job.created_at}`
      + (job.finished_at ? `, finished ${job.finished_at}` : "")) : null,
    status.error ? el("p", { class: "error" }, status.error) : null));
    return status.running;
  };
  render().then((running) => {
    if (!running) return;
    const timer = setInterval(async () => {
      if (!(await render())) clearInterval(timer);
    }, 1000);
    timers.push(timer);
  });
}

async function backfillPage(table, params) {
  const parts = [el("h2", {}, "Backfill"), el("p", { class: "note" },
    "Copies the published messages a retention kept, in seq order, as new messages to a target "
    + "(one added later, say); the relays then deliver them. Stopped at any point, it goes on "
    + "from where it was when started again under the same name.")];
  const status = el("div", { id: "backfill-progress" });
  if (!session.changes) {
    parts.push(el("p", { class: "note" }, `Starting a backfill needs a console that changes: ${session.read_only_reason}.`));
  } else if (!session.signed_in) {
    parts.push(el("p", { class: "note" }, "Sign in to start a backfill."));
  } else {
    const form = backfillForm(table);
    const outcome = el("div", { id: "outcome" });
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      localStorage.setItem("relaybox-actor", form.elements.actor.value);
      outcome.replaceChildren();
      try {
        const preview = await post(`api/tables/${table}/backfills`, backfillBody(form, true));
        const name = preview.name;
        const to = form.elements.to.value;
        const start = el("button", { type: "button", id: "confirm", onclick: async () => {
          try {
            await post(`api/tables/${table}/backfills`, backfillBody(form, false));
            outcome.replaceChildren(el("div", { class: "preview", id: "preview" }, ...describePlan(preview, to)));
            followBackfill(table, name, preview.plan.count, status);
          } catch (error) { outcome.replaceChildren(errorBox(error)); }
        } }, "Start backfill");
        const cancel = el("button", { type: "button", onclick: () => outcome.replaceChildren() }, "Cancel");
        outcome.replaceChildren(el("div", { class: "preview", id: "preview" }, ...describePlan(preview, to),
          preview.plan.count ? start : null, cancel));
      } catch (error) { outcome.replaceChildren(errorBox(error)); }
    });
    parts.push(form, el("p", { class: "note" }, "A dry run shows what would be copied first; nothing is copied until you start it."), outcome);
  }
  const lookup = el("input", { name: "job", id: "bf-lookup", value: params.get("name") || "", "aria-label": "job name" });
  parts.push(el("form", { class: "lookup", onsubmit: (event) => {
    event.preventDefault();
    location.hash = `#/t/${table}/backfill?${new URLSearchParams({ name: lookup.value })}`;
  } }, el("label", {}, "Show the job named ", lookup), " ", el("button", { type: "submit" }, "Show")));
  parts.push(status);
  show(...parts);
  if (params.get("name")) followBackfill(table, params.get("name"), null, status);
}

// -- audit ---------------------------------------------------------------------------

async function audit(table, params) {
  const page = await api(`api/tables/${table}/audit?${params}`);
  const head = el("tr", {}, ["id", "at", "actor", "action", "reason", "message", "key"].map((n) => el("th", {}, n)));
  const rows = page.records.map((r) => el("tr", {}, el("td", {}, r.id), el("td", {}, r.at),
    el("td", {}, r.actor), el("td", {}, r.action), el("td", {}, shown(r.reason)),
    el("td", {}, messageLink(table, r)), el("td", {}, keyName(r.target, r.key))));
  const parts = [el("h2", {}, "Audit"),
    rows.length ? el("table", { class: "audit" }, head, rows) : el("p", { class: "note" }, "No change recorded yet.")];
  if (page.next_before !== null) {
    parts.push(el("p", {}, el("a", { href: `#/t/${table}/audit?before=${page.next_before}` }, "Older")));
  }
  show(...parts);
}

// -- routing -------------------------------------------------------------------------

async function route() {
  stopTimers();
  shownPage += 1;
  const [path, query] = location.hash.replace(/^#/, "").split("?");
  const params = new URLSearchParams(query || "");
  const parts = path.split("/").filter(Boolean);
  try {
    if (parts[0] === "t" && parts[2] === "search") await search(parts[1], params);
    else if (parts[0] === "t" && parts[2] === "m") await message(parts[1], parts[3]);
    else if (parts[0] === "t" && parts[2] === "audit") await audit(parts[1], params);
    else if (parts[0] === "t" && parts[2] === "backfill") await backfillPage(parts[1], params);
    else {
      await overview();
      every(REFRESH_MS, refreshOverview);
    }
  } catch (error) {
    show(errorBox(error));
  }
}

// The overview again, while the page is visible; a failed refresh keeps what is shown
// and says why.
async function refreshOverview() {
  if (document.visibilityState !== "visible") return;
  try {
    await overview();
  } catch (error) {
    const note = document.getElementById("refreshed");
    if (note) note.replaceChildren(errorBox(error));
  }
}

window.addEventListener("hashchange", route);
document.addEventListener("DOMContentLoaded", async () => {
  try { await loadSession(); } catch (error) { show(errorBox(error)); return; }
  route();
});
