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

let session = { changes: false, signed_in: false, csrf: null, read_only_reason: null };

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

// -- overview ------------------------------------------------------------------------

async function overview() {
  const { tables } = await api("api/tables");
  show(...tables.map((table) => {
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
        el("a", { href: `#/t/${table.index}/audit` }, "Audit")),
      el("h3", {}, "Messages by status"), el("table", { class: "counts" }, counts,
        el("tr", {}, el("th", {}, "held (of the above)"), el("td", {}, count(table.held, { state: "held" })))),
      el("h3", {}, "By target: still to deliver, and stuck"),
      targets.length ? el("table", { class: "targets" }, targetHead, targets) : el("p", { class: "note" }, "Nothing."),
      table.stuck_more ? el("p", { class: "note" }, "Stuck counts are of the newest 1000 stuck messages.") : null,
      el("h3", {}, "Live relays"),
      table.relays.length
        ? el("table", { class: "relays" },
          el("tr", {}, ["relay", "target", "partitions held", "since", "lease until"].map((n) => el("th", {}, n))),
          table.relays.map((r) => el("tr", {}, el("td", {}, r.worker), el("td", {}, r.target),
            el("td", { title: r.partitions.join(", ") }, r.partitions.length), el("td", {}, r.joined_at),
            el("td", {}, r.lease_until))))
        : el("p", { class: "note" }, "None (or relays that lease rows, not partitions)."),
      el("p", { class: "note" },
        `Oldest due message waits: ${table.oldest_pending_age === null ? "—" : `${table.oldest_pending_age.toFixed(1)} s`}; `
        + `leases held: ${table.active_leases}`));
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

function actionsPanel(table, selection, what, done) {
  if (!session.changes) return null;
  if (!session.signed_in) {
    return el("section", { class: "actions" }, el("p", { class: "note" }, "Sign in to act on messages."));
  }
  const actor = el("input", { name: "actor", id: "actor", value: localStorage.getItem("relaybox-actor") || "" });
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
  const [path, query] = location.hash.replace(/^#/, "").split("?");
  const params = new URLSearchParams(query || "");
  const parts = path.split("/").filter(Boolean);
  try {
    if (parts[0] === "t" && parts[2] === "search") await search(parts[1], params);
    else if (parts[0] === "t" && parts[2] === "m") await message(parts[1], parts[3]);
    else if (parts[0] === "t" && parts[2] === "audit") await audit(parts[1], params);
    else await overview();
  } catch (error) {
    show(errorBox(error));
  }
}

window.addEventListener("hashchange", route);
document.addEventListener("DOMContentLoaded", async () => {
  try { await loadSession(); } catch (error) { show(errorBox(error)); return; }
  route();
});
