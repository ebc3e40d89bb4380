// The status page: polls the coordinator's API and redraws. Plain DOM, no build step.
// Every value from the API is set with textContent, never as HTML.
"use strict";

const REFRESH_MS = 2000;
const ERRORS_SHOWN = 5;
const TOKEN_KEY = "layertap-api-token";

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k === "style") node.style.cssText = v;
    else node.setAttribute(k, v);
  }
  for (const child of children) node.append(child instanceof Node ? child : String(child));
  return node;
}

const fmt = {
  int: (n) => Number(n).toLocaleString("en-US"),
  rate: (n) => Number(n).toLocaleString("en-US", { maximumFractionDigits: n < 10 ? 2 : 0 }),
  pct: (r) => (100 * r).toFixed(1) + "%",
  bytes(n) {
    if (n === null || n === undefined || n === "") return "-";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let v = Number(n), i = 0;
    while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    return (i ? v.toFixed(1) : v.toFixed(0)) + " " + units[i];
  },
  duration(s) {
    if (s === null || s === undefined) return "-";
    s = Math.round(s);
    const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
    return h ? `${h}h${String(m).padStart(2, "0")}m` : `${m}m${String(sec).padStart(2, "0")}s`;
  },
};

async function api(path) {
  const token = localStorage.getItem(TOKEN_KEY);
  const reply = await fetch(path, { headers: token ? { Authorization: `Bearer ${token}` } : {} });
  if (reply.status === 401) {
    document.getElementById("token-form").hidden = false;
    throw new Error("this coordinator needs an API token: enter it above");
  }
  if (!reply.ok) throw new Error(`${path}: HTTP ${reply.status}`);
  return reply.json();
}

function progressBar(done, failed, total) {
  total = total || 1;
  const ratio = Math.min(1, (done + failed) / total);
  failed /= total;
  return el("div", { class: "bar", role: "progressbar", "aria-valuenow": (100 * ratio).toFixed(1),
                     "aria-valuemin": "0", "aria-valuemax": "100" },
    el("div", { class: "fill", style: `width:${(100 * ratio).toFixed(2)}%` }),
    el("div", { class: "fail", style: `width:${(100 * failed).toFixed(2)}%` }),
    el("span", { class: "label" }, fmt.pct(ratio)));
}

function stat(name, value) {
  return el("div", {}, `${name} `, el("b", {}, value));
}

function jobCard(job, errors) {
  const handled = job.samples_done + job.samples_failed;
  const ratio = job.samples_total ? handled / job.samples_total : 1;
  const shards = Object.entries(job.shards).sort().map(([s, n]) => `${n} ${s}`).join(", ");
  const tokens = fmt.int(job.tokens_done) + (job.tokens_total_estimate ? ` of ~${fmt.int(job.tokens_total_estimate)}` : "");
  const card = el("article", { class: `job ${job.state}`, "data-job-id": job.job_id, "data-progress": ratio.toFixed(4),
                               "data-samples-done": job.samples_done },
    el("div", { class: "job-head" },
      el("span", { class: "job-id" }, job.job_id),
      el("span", { class: `badge ${job.state}` }, job.state),
      el("span", { class: "muted" }, job.out)),
    progressBar(job.samples_done, job.samples_failed, job.samples_total),
    el("div", { class: "stats" },
      stat("samples", `${fmt.int(job.samples_done)} / ${fmt.int(job.samples_total)}`),
      stat("failed", fmt.int(job.samples_failed)),
      stat("tokens", tokens),
      stat("stored", job.bytes_done_estimate == null ? "-" : `~${fmt.bytes(job.bytes_done_estimate)} (${job.store_dtype})`),
      stat("samples/s", fmt.rate(job.samples_per_s)),
      stat("tokens/s", fmt.rate(job.tokens_per_s)),
      ...generationStats(job.generation),
      stat("ETA", job.state === "running" ? fmt.duration(job.eta_s) : "-"),
      stat("shards", shards)));
  if (job.error) card.append(el("div", { class: "error" }, `error: ${job.error}`));
  if (job.audit) card.append(auditLine(job.audit));
  if (errors && errors.count) {
    const list = el("ul", { class: "errors" });
    for (const e of errors.errors.slice(0, ERRORS_SHOWN)) {
      list.append(el("li", {}, `row ${e.row} (${e.kind}): ${e.reason}`));
    }
    if (errors.count > ERRORS_SHOWN) list.append(el("li", {}, `... and ${errors.count - ERRORS_SHOWN} more`));
    card.append(list);
  }
  const live = job.workers.filter((w) => w.alive);
  if (job.workers.length) {
    card.append(el("div", { class: "job-workers" }, "workers: " + job.workers.map((w) =>
      `${w.name} ${fmt.int(w.samples)} samples` + (w.alive ? ` (shard ${w.shard ?? "-"}, ${fmt.rate(w.samples_per_s)}/s)` : "")
    ).join(" · ") + (live.length ? "" : " (none working on it now)")));
  }
  return card;
}

// A regenerating job's generation (none for a job that does not regenerate): the rows regenerated, the new tokens and
// their rate beside the capture's, and the turns cut at max_new_tokens (kept, finish_reason length).
function generationStats(gen) {
  if (!gen) return [];
  return [
    stat("regenerated", `${fmt.int(gen.rows)} rows, ${fmt.int(gen.tokens)} tokens`),
    stat("generated/s", fmt.rate(gen.tokens_per_s)),
    el("div", { "data-cut-turns": gen.cut_turns }, "cut at max_new_tokens ", el("b", {}, fmt.int(gen.cut_turns))),
  ];
}

// The job's audit of its own store: a FAIL leaves the job done, so it is shown in red beside the state. While it
// runs: its device and how far its reference is (layers run over every audited sample), with a bar.
function auditLine(audit) {
  const verdict = ["pass", "fail", "inconclusive"].includes(audit.state) ? audit.state.toUpperCase() : audit.state;
  const where = (audit.device ? ` on ${audit.device}` : "")
    + (audit.layers_total ? `, ${fmt.int(audit.layers_done)} / ${fmt.int(audit.layers_total)} layers` : "");
  const text = audit.summary
    || `${fmt.int(audit.samples)} samples` + (audit.state === "pending" ? ", once the job has ended" : "");
  const line = el("div", { class: `audit ${audit.state}`, "data-audit": audit.state },
    "audit ", el("span", { class: `badge ${audit.state}` }, verdict), `${where}${where ? ":" : ""} ${text}`);
  if (audit.report) line.append(el("span", { class: "muted" }, ` report: ${audit.report}`));
  if (audit.state === "running" && audit.layers_total) {
    line.append(progressBar(audit.layers_done, 0, audit.layers_total));
  }
  return line;
}

function workerRow(w) {
  const state = el("td", {}, el("span", { class: `badge ${w.state}` }, w.state));
  const row = el("tr", { "data-worker": w.name },
    el("td", {}, w.name), state,
    el("td", {}, w.job ? `${w.job} / ${w.shard ?? "finalize"}` : "-"),
    el("td", {}, fmt.rate(w.samples_per_s)), el("td", {}, fmt.rate(w.tokens_per_s)),
    el("td", {}, fmt.rate(w.generated_tokens_per_s)),
    el("td", {}, fmt.bytes(w.free_bytes)), el("td", {}, w.host || "-"));
  if (w.reason) state.append(el("div", { class: "reason" }, w.reason));
  return row;
}

// A stream's producer (a CLI run or a job): held means it waits at its bound of unacked samples, its consumers behind;
// paused, its job cancelled; dead, the samples a consumer could not use (dead-lettered: settled, not delivered).
function streamRow(s) {
  return el("tr", { "data-stream": s.name, "data-state": s.state, "data-in-flight": s.in_flight },
    el("td", {}, s.name), el("td", {}, el("span", { class: `badge ${s.state}` }, s.state)),
    el("td", {}, fmt.int(s.put)), el("td", {}, fmt.int(s.acked)),
    el("td", {}, `${fmt.int(s.in_flight)} / ${fmt.int(s.bound)}`), el("td", {}, fmt.duration(s.held_s)),
    el("td", {}, fmt.int(s.dead)));
}

async function refresh() {
  const problem = document.getElementById("problem");
  try {
    const [jobs, workers, streams] = await Promise.all([api("/jobs?limit=20"), api("/workers"), api("/streams")]);
    const withErrors = jobs.jobs.filter((j) => j.samples_failed > 0);
    const errors = Object.fromEntries(await Promise.all(
      withErrors.map(async (j) => [j.job_id, await api(`/jobs/${encodeURIComponent(j.job_id)}/errors`)])));
    const jobsBox = document.getElementById("jobs");
    jobsBox.replaceChildren(...(jobs.count ? jobs.jobs.map((j) => jobCard(j, errors[j.job_id]))
                                           : [el("p", { class: "muted" }, "No jobs yet.")]));
    const body = document.querySelector("#workers tbody");
    body.replaceChildren(...(workers.count ? workers.workers.map(workerRow)
                                           : [el("tr", {}, el("td", { colspan: "8", class: "muted" }, "No live workers."))]));
    document.querySelector("#streams tbody").replaceChildren(...(streams.count ? streams.streams.map(streamRow)
                                           : [el("tr", {}, el("td", { colspan: "7", class: "muted" }, "No streams."))]));
    problem.hidden = true;
    document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (err) {
    problem.textContent = String(err.message || err);
    problem.hidden = false;
  }
}

document.getElementById("token-form").addEventListener("submit", (event) => {
  event.preventDefault();
  localStorage.setItem(TOKEN_KEY, document.getElementById("token").value);
  document.getElementById("token-form").hidden = true;
  refresh();
});

refresh();
setInterval(refresh, REFRESH_MS);
