// The gateway's browser page: submit a graph (with input files uploaded to the bucket first),
// once or as a batch (a count above 1), then follow the job or the batch until it ends.
//
// Following is one loop per job or batch: stream the events (Server-Sent Events, read with
// fetch(), because EventSource cannot send an Authorization header); when the stream fails, say
// "reconnecting…", poll the status meanwhile, and open the stream again from the last event
// seen, after a backoff. The state lives server-side, so the page only ever loses sight of a
// job or a batch, never the thing itself.
"use strict";

// Every number of the retry policy. Waits are "full jitter": random(0, min(ceiling,
// base·2^n)), so many pages that lost the same gateway do not come back in lockstep.
const RETRY = {
  baseMs: 500,
  ceilingMs: 15_000, // the longest wait while the gateway still answers something
  contactHorizonMs: 60_000, // no answer at all for this long: "contact lost"
  lostCeilingMs: 60_000, // the slow retry after contact is lost
  requestTimeoutMs: 10_000, // a poll or a submit that takes longer counts as no answer
  // The gateway sends a comment every 15 s: a stream silent this long is dead.
  streamSilenceMs: 45_000,
  submitAttempts: 5, // a POST that got no answer is sent again, with the same key
};

// The states a job ends in, as the gateway names them (`GET /v1/config`).
let terminalStates = new Set();
// Whether the job has ended, as its worker wrote it (`terminal`): a state a newer worker added
// is shown by its name and still ends the page's following. A status from before the flag falls
// back to the gateway's terminal states.
function isTerminal(status) {
  return typeof status.terminal === "boolean" ? status.terminal : terminalStates.has(status.state);
}
const KEY_STORAGE = "durable-comfy.api-key";

const $ = (id) => document.getElementById(id);

// An answer that retrying cannot change (no key, another tenant's job): stop and say why.
class Refused extends Error {}

function backoffMs(attempt, ceilingMs) {
  return Math.random() * Math.min(ceilingMs, RETRY.baseMs * 2 ** attempt);
}

function retryAfterMs(response) {
  const seconds = Number(response.headers.get("Retry-After"));
  return Number.isFinite(seconds) && seconds > 0 ? seconds * 1000 : 0;
}

// --- talking to the gateway -------------------------------------------------------------

function apiKey() {
  return $("api-key").value.trim();
}

function headers(extra = {}) {
  const key = apiKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

async function errorText(response) {
  try {
    const { error } = await response.json();
    // A refused request lists each problem with where it is (field path, node): one a line.
    const problems = (error.problems || []).map((p) => `  ${(p.loc || []).join(".")}: ${p.message}`);
    return problems.length ? [`${error.type}:`, ...problems].join("\n") : `${error.type}: ${error.message}`;
  } catch {
    return `HTTP ${response.status}`;
  }
}

// A random Idempotency-Key; crypto.randomUUID() exists only on https or localhost pages.
function newIdempotencyKey() {
  const bytes = crypto.getRandomValues(new Uint8Array(16));
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

const sleep = (ms, signal) =>
  new Promise((resolve) => {
    const timer = setTimeout(resolve, ms);
    signal?.addEventListener("abort", () => (clearTimeout(timer), resolve()), { once: true });
  });

// --- the configuration and the submit ---------------------------------------------------

let exampleGraph = null;
let maxBodyBytes = Infinity; // the gateway's limit: a larger graph is refused before it is sent
// Input files the gateway takes: extension → the type it is sent as, and the largest size.
// Unknown (no configuration): the gateway's answer to each upload says.
let uploadTypes = null;
let uploadMaxBytes = Infinity;

async function loadConfig() {
  try {
    const response = await fetch("v1/config", { signal: AbortSignal.timeout(RETRY.requestTimeoutMs) });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const config = await response.json();
    exampleGraph = config.example_graph ?? null;
    maxBodyBytes = config.max_body_bytes ?? Infinity;
    uploadTypes = config.uploads?.types ?? null;
    uploadMaxBytes = config.uploads?.max_bytes ?? Infinity;
    terminalStates = new Set(config.terminal_states ?? []);
    if (uploadTypes) $("files").accept = Object.keys(uploadTypes).join(",");
    $("key-section").hidden = config.auth_required === false;
    document.body.dataset.config = "loaded";
  } catch {
    // Without the configuration the key field stays, and the example button says why.
    document.body.dataset.config = "missing";
  }
}

function readGraph() {
  let graph;
  try {
    graph = JSON.parse($("graph").value);
  } catch (error) {
    throw new Refused(`The graph is not JSON: ${error.message}`);
  }
  if (graph === null || typeof graph !== "object" || Array.isArray(graph)) {
    throw new Refused("The graph must be a JSON object of nodes (ComfyUI's API format).");
  }
  if (Array.isArray(graph.nodes) && Array.isArray(graph.links)) {
    throw new Refused("This is ComfyUI's UI format: export the graph with Save (API format).");
  }
  return graph;
}

// How many jobs of the graph to submit: 1 is one job, more a batch.
function readCount() {
  const count = $("count").valueAsNumber;
  if (!Number.isInteger(count) || count < 1) {
    throw new Refused("Count: how many jobs of this graph to run, a whole number from 1.");
  }
  return count;
}

// A batch runs to its end (following a batch is no client contact for its jobs): the choice to
// stop the job when the page closes is a single job's only.
function countChanged() {
  const batched = $("count").valueAsNumber > 1;
  $("stop-on-close").disabled = batched;
  $("stop-on-close").closest("label").title = batched ? "A batch runs to its end: cancel it to stop it." : "";
}

async function submit() {
  const button = $("submit");
  showSubmitError("");
  let graph;
  let files;
  let count;
  try {
    graph = readGraph();
    count = readCount();
    files = chosenFiles();
  } catch (error) {
    showSubmitError(error.message);
    return;
  }
  button.disabled = true;
  try {
    // Detached unless asked otherwise: following is a view, not a lease, so the job outlives
    // the tab. "Stop the job when I close this page" submits it attached: nobody following it
    // for its abandon horizon abandons it, and frees the GPU.
    const request = { graph, detached: !$("stop-on-close").checked };
    if (files.length) request.inputs = await uploadFiles(files);
    // A batch: the same request `count` times (the gateway varies the seeds), `detached` beside
    // it, as the batch's. Always detached: a batch is stopped with its Cancel button.
    const each = { ...request };
    delete each.detached;
    const batched = count > 1;
    const body = JSON.stringify(batched ? { request: each, count, detached: true } : request);
    const size = new TextEncoder().encode(body).length;
    if (size > maxBodyBytes) {
      throw new Refused(`The request is ${size} bytes; this gateway takes at most ${maxBodyBytes}.`);
    }
    // One key per click: a POST sent again after a lost answer finds the job (or batch) the
    // first started.
    if (batched) {
      const made = await postNew("v1/batches", body, newIdempotencyKey());
      location.hash = `batch=${encodeURIComponent(made.batch_id)}`; // the hashchange follows it
    } else {
      const job = await postJob(body, newIdempotencyKey());
      location.hash = `job=${encodeURIComponent(job.job_id)}`; // the hashchange follows it
    }
  } catch (error) {
    showSubmitError(error.message);
  } finally {
    button.disabled = false;
  }
}

// --- input files: hashed here, presigned by the gateway, PUT straight to the bucket ------

// The files picked, each checked against what the gateway takes before any is read.
function chosenFiles() {
  const files = [...$("files").files];
  $("uploads").replaceChildren();
  for (const file of files) {
    const type = uploadType(file);
    if (!type) {
      const accepted = Object.keys(uploadTypes).join(" ");
      throw new Refused(`${file.name}: not an input file this gateway takes (${accepted}).`);
    }
    if (file.size > uploadMaxBytes) {
      const most = `this gateway takes files of at most ${uploadMaxBytes}`;
      throw new Refused(`${file.name} is ${file.size} bytes; ${most}.`);
    }
  }
  // crypto.subtle exists only on https or localhost pages.
  if (files.length && !globalThis.crypto?.subtle) {
    throw new Refused(
      "Uploading needs this page over https (or on localhost): the browser hashes files only there.",
    );
  }
  return files;
}

// The type a file is sent as: the gateway's for its extension (the only one it accepts).
function uploadType(file) {
  if (!uploadTypes) return file.type || "application/octet-stream";
  const dot = file.name.lastIndexOf(".");
  return dot < 0 ? null : uploadTypes[file.name.slice(dot).toLowerCase()] ?? null;
}

// Uploads each file in turn; the job's inputs, each under its file's name.
async function uploadFiles(files) {
  const inputs = {};
  for (const file of files) {
    const row = document.createElement("li");
    $("uploads").append(row);
    const show = (state, text) => {
      row.dataset.upload = state;
      row.textContent = `${file.name}: ${text}`;
    };
    try {
      show("hashing", "hashing…");
      const sha256 = await sha256Hex(file);
      show("asking", "asking the gateway where to put it…");
      const answer = await presignUpload(file, sha256);
      if (answer.exists) {
        show("done", "already uploaded ✓");
      } else {
        const progress = (fraction) => show("uploading", `uploading… ${Math.floor(fraction * 100)} %`);
        await putFile(answer, file, progress);
        show("done", `uploaded ✓ (${file.size} bytes)`);
      }
      inputs[file.name] = { kind: "s3", uri: answer.uri };
    } catch (error) {
      show("failed", `not uploaded: ${error.message}`);
      throw new Refused(`Not submitted: ${file.name} was not uploaded (${error.message}).`);
    }
  }
  return inputs;
}

async function sha256Hex(file) {
  const digest = await crypto.subtle.digest("SHA-256", await file.arrayBuffer());
  return Array.from(new Uint8Array(digest), (b) => b.toString(16).padStart(2, "0")).join("");
}

async function presignUpload(file, sha256) {
  let response;
  try {
    response = await fetch("v1/uploads", {
      method: "POST",
      headers: headers({ "Content-Type": "application/json" }),
      body: JSON.stringify({
        filename: file.name,
        size: file.size,
        sha256,
        content_type: uploadType(file),
      }),
      signal: AbortSignal.timeout(RETRY.requestTimeoutMs),
    });
  } catch (error) {
    throw new Refused(`the gateway did not answer (${error.message})`);
  }
  if (!response.ok) throw new Refused(await errorText(response));
  return await response.json();
}

// The PUT, with the headers the gateway signed (XMLHttpRequest: fetch reports no upload
// progress). The bucket refuses any other bytes, length or type.
function putFile(answer, file, onProgress) {
  return new Promise((resolve, reject) => {
    const xhr = new XMLHttpRequest();
    xhr.open("PUT", answer.put_url);
    for (const [name, value] of Object.entries(answer.headers)) {
      // The browser sends the file's own Content-Length; a page may not set it.
      if (name.toLowerCase() !== "content-length") xhr.setRequestHeader(name, value);
    }
    xhr.upload.addEventListener("progress", (e) => e.lengthComputable && onProgress(e.loaded / e.total));
    xhr.addEventListener("load", () => {
      if (xhr.status >= 200 && xhr.status < 300) return resolve();
      const code = /<Code>([^<]*)<\/Code>/.exec(xhr.responseText || "")?.[1];
      reject(new Error(`the bucket refused it: HTTP ${xhr.status}${code ? ` ${code}` : ""}`));
    });
    xhr.addEventListener("error", () =>
      reject(new Error("the bucket did not answer, or its CORS rules do not let this page PUT")),
    );
    xhr.send(file);
  });
}

function postJob(body, idempotencyKey) {
  return postNew("v1/jobs", body, idempotencyKey);
}

// A submit (a job, a batch): sent again with the same key while the gateway does not answer or
// is busy, so that the retries start one thing.
async function postNew(path, body, idempotencyKey) {
  let lastProblem = "no answer";
  for (let attempt = 0; attempt < RETRY.submitAttempts; attempt++) {
    let waitMs = backoffMs(attempt, RETRY.ceilingMs);
    try {
      const response = await fetch(path, {
        method: "POST",
        headers: headers({ "Content-Type": "application/json", "Idempotency-Key": idempotencyKey }),
        body,
        signal: AbortSignal.timeout(RETRY.requestTimeoutMs),
      });
      if (response.ok) return await response.json();
      lastProblem = await errorText(response);
      // Busy (429, 503) is worth another try; anything else is the request's own fault.
      if (response.status !== 429 && response.status !== 503) throw new Refused(lastProblem);
      waitMs = Math.max(waitMs, retryAfterMs(response));
    } catch (error) {
      if (error instanceof Refused) throw error;
      lastProblem = `the gateway did not answer (${error.message})`;
    }
    showSubmitError(`Not submitted yet: ${lastProblem}. Trying again…`);
    await sleep(waitMs);
  }
  throw new Refused(`Not submitted: ${lastProblem}`);
}

function showSubmitError(text) {
  $("submit-error").textContent = text;
  $("submit-error").hidden = !text;
}

// --- following a job or a batch ---------------------------------------------------------

// What following needs to know of what it follows: its name, where it is, what an event and a
// status do to the page, and the line that says how the following goes. A run (below) without
// a `view` is a job's.
const JOB_VIEW = {
  noun: "job",
  path: (id, tail = "") => jobPath(id, tail),
  onEvent: (run, event) => onEvent(run, event),
  apply: (run, status) => applyStatus(run, status),
  show: (kind, detail, waitMs) => showConnection(kind, detail, waitMs),
};
const BATCH_VIEW = {
  noun: "batch",
  path: (id, tail = "") => batchPath(id, tail),
  onEvent: (run, event) => onBatchEvent(run, event),
  apply: (run, status) => applyBatchStatus(run, status),
  show: (kind, detail, waitMs) => showBatchConnection(kind, detail, waitMs),
};

const viewOf = (run) => run.view || JOB_VIEW;

// The job on screen (or the batch: one at a time, as the address's hash names it).
// `lastEventId` is the id of the last event a stream delivered: the next stream starts after
// it, so no state change or output is missed or shown twice.
let job = null;
let batch = null;

function newRun(id, view) {
  const abort = new AbortController();
  return {
    id,
    view,
    status: null,
    lastEventId: null,
    etag: null,
    outputs: new Map(), // a job's: key → artifact, in the order they were stored
    ended: false,
    stopped: false,
    abort,
    wake: null, // ends the current wait early (the Retry button)
    stop() {
      this.stopped = true;
      abort.abort();
    },
  };
}

// Following a job stops following a batch, and the other way round; a batch the job is part of
// (as the page last showed it) is linked from the job.
function stopFollowingBatch() {
  batch?.stop();
  batch = null;
  $("batch-section").hidden = true;
}

function stopFollowingJob() {
  job?.stop();
  job = null;
  $("job-section").hidden = true;
}

function startFollowing(jobId) {
  if (job?.id === jobId && !job.stopped) return;
  const listed = batch?.status?.jobs?.some((j) => j.job_id === jobId);
  const from = listed ? batch.id : job?.id === jobId ? job.batchId : null;
  stopFollowingBatch();
  job?.stop();
  job = newRun(jobId, JOB_VIEW);
  job.batchId = from;
  renderNewJob(jobId);
  $("job-batch").hidden = !from;
  if (from) {
    $("job-batch-link").textContent = from;
    $("job-batch-link").href = `#batch=${encodeURIComponent(from)}`;
  }
  follow(job).catch((error) => showConnection("stopped", `Stopped following: ${error.message}`));
}

function startFollowingBatch(batchId) {
  if (batch?.id === batchId && !batch.stopped) return;
  stopFollowingJob();
  batch?.stop();
  batch = newRun(batchId, BATCH_VIEW);
  renderNewBatch(batchId);
  const run = batch;
  follow(run).catch((error) => showBatchConnection("stopped", `Stopped following: ${error.message}`));
}

async function follow(run) {
  const view = viewOf(run);
  let attempt = 0;
  let lastAnswerAt = Date.now();
  const answered = () => {
    lastAnswerAt = Date.now();
  };
  const contactLost = () => Date.now() - lastAnswerAt > RETRY.contactHorizonMs;
  while (!run.stopped && !run.ended) {
    let busy = null; // the gateway's own answer when it refused to stream (busy, unavailable)
    try {
      const delivered = await streamEvents(run, answered);
      if (delivered) attempt = 0;
    } catch (error) {
      if (error instanceof Refused) return refuse(run, error.message);
      busy = error;
    }
    if (run.stopped || run.ended) break;
    view.show(contactLost() ? "lost" : "reconnecting", busy?.message);
    let polled = null;
    try {
      polled = await pollStatus(run, answered);
    } catch (error) {
      if (error instanceof Refused) return refuse(run, error.message);
    }
    if (run.stopped || run.ended) break;
    const lost = contactLost();
    const ceilingMs = lost ? RETRY.lostCeilingMs : RETRY.ceilingMs;
    const waitMs = Math.max(busy?.retryAfterMs || 0, backoffMs(attempt++, ceilingMs));
    view.show(lost ? "lost" : "reconnecting", polled || busy?.message, waitMs);
    const woken = new AbortController();
    run.wake = () => woken.abort();
    await sleep(waitMs, AbortSignal.any([woken.signal, run.abort.signal]));
    run.wake = null;
  }
}

function refuse(run, message) {
  run.stopped = true;
  viewOf(run).show("stopped", message);
}

// Reads the event stream until it ends or fails; returns whether it delivered any event.
// Throws Refused (401, 404) or, when the gateway answered busy, an Error with retryAfterMs.
async function streamEvents(run, answered) {
  const view = viewOf(run);
  const abort = new AbortController();
  const signal = AbortSignal.any([abort.signal, run.abort.signal]);
  let watchdog = setTimeout(() => abort.abort(), RETRY.streamSilenceMs);
  const heard = () => {
    answered();
    clearTimeout(watchdog);
    watchdog = setTimeout(() => abort.abort(), RETRY.streamSilenceMs);
  };
  let delivered = false;
  let response;
  try {
    const extra = { Accept: "text/event-stream" };
    if (run.lastEventId !== null) extra["Last-Event-ID"] = run.lastEventId;
    try {
      response = await fetch(view.path(run.id, "/events"), { headers: headers(extra), signal, cache: "no-store" });
    } catch {
      return false; // no answer: the caller reconnects
    }
    heard();
    if (!response.ok) throw await answerError(response, view.noun);
    view.show("live");
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      let chunk;
      try {
        chunk = await reader.read();
      } catch {
        return delivered; // dropped, or silent past the watchdog
      }
      if (chunk.done) return delivered;
      heard();
      buffer += chunk.value;
      // An event ends at a blank line; whatever follows the last one waits for more text.
      const blocks = buffer.split(/\r\n\r\n|\n\n|\r\r/);
      buffer = blocks.pop();
      for (const block of blocks) {
        const event = parseEvent(block);
        if (!event) continue;
        delivered = true;
        view.onEvent(run, event);
        if (run.ended) return delivered;
      }
    }
  } finally {
    clearTimeout(watchdog);
    abort.abort(); // also closes a stream left open after the job (or batch) ended
  }
}

function parseEvent(block) {
  let id = null;
  let name = "message";
  const data = [];
  for (const line of block.split(/\r\n|\n|\r/)) {
    if (!line || line.startsWith(":")) continue; // a comment: the keep-alive
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
    if (field === "id") id = value;
    else if (field === "event") name = value;
    else if (field === "data") data.push(value);
  }
  if (!data.length) return null;
  return { id, name, data: JSON.parse(data.join("\n")) };
}

// A non-2xx answer as an error: Refused when retrying cannot help (no key, no such job),
// else one that carries how long the gateway asked us to wait.
async function answerError(response, noun = "job") {
  const text = await errorText(response);
  if (response.status === 401) return new Refused(`${text} — enter a valid API key above.`);
  if (response.status === 404) return new Refused(`${text} — no such ${noun} for this API key.`);
  const error = new Error(`The gateway answered: ${text}`);
  error.retryAfterMs = retryAfterMs(response);
  return error;
}

function onEvent(run, { id, name, data }) {
  // Ids only grow along a stream; one may be `<seq>.<k>` (the k-th entry of a seq), so it is
  // sent back exactly as received.
  if (id !== null) run.lastEventId = id;
  if (name === "status") return applyStatus(run, data);
  if (name === "end") return endFollowing(run);
  // Journal entries older than the status on screen are already part of it.
  if (run.status && data.seq <= run.status.seq) return;
  if (name === "state") renderState(data.state);
  else if (name === "progress") renderPercent(data.percent);
  else if (name === "output_stored" && data.artifact) addOutput(run, data.artifact);
}

// One status poll while the stream is down. Returns what went wrong, if the gateway said.
async function pollStatus(run, answered) {
  const view = viewOf(run);
  const extra = run.etag ? { "If-None-Match": run.etag } : {};
  let response;
  try {
    response = await fetch(view.path(run.id), {
      headers: headers(extra),
      cache: "no-store",
      signal: AbortSignal.any([run.abort.signal, AbortSignal.timeout(RETRY.requestTimeoutMs)]),
    });
  } catch {
    return null; // no answer: the contact horizon keeps counting
  }
  answered();
  if (response.status === 304) return null;
  if (!response.ok) {
    const error = await answerError(response, view.noun);
    if (error instanceof Refused) throw error;
    return error.message;
  }
  run.etag = response.headers.get("ETag");
  view.apply(run, await response.json());
  return null;
}

function applyStatus(run, status) {
  if (run.status && status.seq < run.status.seq) return; // an older answer arriving late
  run.status = status;
  for (const artifact of status.artifacts || []) addOutput(run, artifact);
  renderStatus(status);
  if (isTerminal(status)) endFollowing(run);
}

function endFollowing(run) {
  if (run.ended) return;
  run.ended = true;
  run.abort.abort();
  showConnection("ended");
  renderGallery(run);
}

// Cancel and resume: sent once per click; what they change arrives with the events.
async function control(button, tail, body) {
  if (!job || job.ended) return;
  button.disabled = true;
  try {
    const response = await fetch(jobPath(job.id, tail), {
      method: "POST",
      headers: headers({ "Content-Type": "application/json" }),
      body: JSON.stringify(body),
      signal: AbortSignal.timeout(RETRY.requestTimeoutMs),
    });
    if (!response.ok) showJobError(await errorText(response));
  } catch (error) {
    showJobError(`Not sent (${error.message}): try again.`);
  } finally {
    button.disabled = false;
  }
}

function jobPath(jobId, tail = "") {
  return `v1/jobs/${encodeURIComponent(jobId)}${tail}`;
}

// A batch's stream sends its whole status (`status`, id: its seq) whenever it changes, then
// `end`; a reconnected stream starts with the batch as it is then, so nothing is missed.
function onBatchEvent(run, { id, name, data }) {
  if (id !== null) run.lastEventId = id;
  if (name === "status") applyBatchStatus(run, data);
  else if (name === "end") endBatchFollowing(run);
  // `error`: the stream ends after it; the loop polls and reconnects.
}

function applyBatchStatus(run, status) {
  if (run.stopped && !run.ended) return; // a batch no longer on screen
  if (run.status && status.seq < run.status.seq) return; // an older answer arriving late
  run.status = status;
  renderBatch(status);
  // The gateway says whether the batch has ended (`terminal`), as it does for a job.
  if (status.terminal === true) endBatchFollowing(run);
}

function endBatchFollowing(run) {
  if (run.ended) return;
  run.ended = true;
  run.abort.abort();
  $("batch-cancel").hidden = true;
  showBatchConnection("ended");
}

// Cancel: sent once per click; the gateway answers the batch as it is then (CANCELLING), and
// its end arrives with the events.
async function cancelBatch(button) {
  const run = batch;
  if (!run || run.ended) return;
  button.disabled = true;
  try {
    const response = await fetch(batchPath(run.id, "/cancel"), {
      method: "POST",
      headers: headers({ "Content-Type": "application/json" }),
      body: JSON.stringify({ reason: "cancelled from the browser page" }),
      signal: AbortSignal.timeout(RETRY.requestTimeoutMs),
    });
    if (!response.ok) showBatchError(await errorText(response));
    else if (run === batch) applyBatchStatus(run, await response.json());
  } catch (error) {
    showBatchError(`Not sent (${error.message}): try again.`);
  } finally {
    button.disabled = false;
  }
}

function batchPath(batchId, tail = "") {
  return `v1/batches/${encodeURIComponent(batchId)}${tail}`;
}

// --- what the page shows ----------------------------------------------------------------

function renderNewJob(jobId) {
  $("job-section").hidden = false;
  $("job-id").textContent = jobId;
  $("job-link").href = `#job=${encodeURIComponent(jobId)}`;
  renderState("—");
  $("queue").textContent = "";
  $("bar").value = 0;
  $("progress-text").textContent = "";
  $("outputs").replaceChildren();
  $("gallery").replaceChildren();
  $("teardown").hidden = true;
  $("cancel").hidden = true;
  $("decision").hidden = true;
  $("webhook").hidden = true;
  showJobError("");
  showConnection("connecting");
}

function renderNewBatch(batchId) {
  $("batch-section").hidden = false;
  $("batch-id").textContent = batchId;
  $("batch-link").href = `#batch=${encodeURIComponent(batchId)}`;
  $("batch-state").textContent = "—";
  $("batch-state").dataset.state = "";
  $("batch-counts").replaceChildren();
  $("batch-bar").value = 0;
  for (const id of ["batch-progress-text", "batch-cost", "batch-artifacts"]) $(id).textContent = "";
  $("batch-cancelled").hidden = true;
  $("batch-webhook").hidden = true;
  $("batch-cancel").hidden = true;
  $("batch-jobs").replaceChildren();
  showBatchError("");
  showBatchConnection("connecting");
}

// The batch as its status says: state, its jobs by state, progress, cost, artifacts, and each
// job linked to its own view on this page.
function renderBatch(status) {
  $("batch-state").textContent = status.state;
  $("batch-state").dataset.state = status.state;
  const counts = Object.entries(status.counts || {}).sort(([a], [b]) => a.localeCompare(b));
  $("batch-counts").replaceChildren(
    ...counts.map(([state, n]) => {
      const item = document.createElement("li");
      item.dataset.state = state;
      item.textContent = `${state}: ${n}`;
      return item;
    }),
  );
  const percent = Math.round((status.progress || 0) * 100);
  $("batch-bar").value = percent;
  $("batch-progress-text").textContent = `${status.ended} of ${status.total} jobs ended · ${percent} %`;
  const cost = status.cost || {};
  const usd = cost.usd == null ? "" : ` (about $${cost.usd.toFixed(4)})`;
  $("batch-cost").textContent = `Cost: ${cost.gpu_s || 0} GPU-seconds billed${usd}`;
  $("batch-artifacts").textContent = `Artifacts: ${status.artifacts ?? 0}`;
  $("batch-cancelled").hidden = !status.cancel_reason;
  $("batch-cancelled").textContent = status.cancel_reason ? `Cancelled: ${status.cancel_reason}` : "";
  $("batch-webhook").hidden = !status.webhook;
  $("batch-webhook").textContent = status.webhook ? `Webhook: ${status.webhook}` : "";
  // Once cancelled there is nothing more to cancel (CANCELLING: its jobs are stopping).
  $("batch-cancel").hidden = status.terminal === true || Boolean(status.cancel_reason);
  $("batch-jobs").replaceChildren(...(status.jobs || []).map(batchJobItem));
}

function batchJobItem(entry) {
  const item = document.createElement("li");
  item.dataset.job = entry.job_id;
  item.dataset.state = entry.state ?? "";
  const link = document.createElement("a");
  link.href = `#job=${encodeURIComponent(entry.job_id)}`;
  const code = document.createElement("code");
  code.textContent = entry.job_id;
  link.append(code);
  // No state yet: not started, or ended and not yet heard of by its batch.
  const parts = [entry.state ?? "—"];
  if (entry.percent != null) parts.push(`${entry.percent} %`);
  if (entry.artifacts) parts.push(`${entry.artifacts} artifact${entry.artifacts === 1 ? "" : "s"}`);
  const state = document.createElement("span");
  state.className = "job-state";
  state.textContent = ` ${parts.join(" · ")}`;
  item.append(link, state);
  if (entry.error) {
    const error = document.createElement("span");
    error.className = "error";
    error.textContent = ` — ${entry.error.type}: ${entry.error.message}`;
    item.append(error);
  }
  return item;
}

function showBatchError(text) {
  $("batch-error").textContent = text;
  $("batch-error").hidden = !text;
}

function renderState(state) {
  $("state").textContent = state;
  $("state").dataset.state = state;
}

function renderPercent(percent) {
  if (percent > $("bar").value) $("bar").value = percent;
}

function renderStatus(status) {
  renderState(status.state);
  const p = status.progress || {};
  const percent = Math.round((p.fraction || 0) * 100);
  $("bar").value = percent;
  const counted = p.total_steps ? `${p.step} / ${p.total_steps} ${p.unit || "steps"} · ` : "";
  const segment = p.segments > 1 ? ` · segment ${p.segment + 1} of ${p.segments}` : "";
  $("progress-text").textContent = `${counted}${percent} %${segment}`;
  $("progress-text").dataset.step = p.step ?? 0;
  // PENDING: its place in our queue for a bounded pool; WAITING: in the backend's own queue.
  const line = status.state === "PENDING" ? placeInLine(status.admission) : null;
  const waiting = status.state === "WAITING" && p.queue_position != null;
  let queue = "";
  if (line) queue = `— ${line}`;
  else if (waiting) queue = `(queue position ${p.queue_position}; 1 is next)`;
  $("queue").textContent = queue;
  showJobError(status.error ? `${status.error.type}: ${status.error.message}` : "");
  const teardown = status.teardown;
  const showTeardown = isTerminal(status) && teardown;
  $("teardown").hidden = !showTeardown;
  if (showTeardown) {
    $("teardown").textContent = `Teardown: ${teardown.state}${teardown.detail ? ` — ${teardown.detail}` : ""}`;
  }
  $("cancel").hidden = isTerminal(status);
  renderDecision(status);
  const hook = status.webhook;
  $("webhook").hidden = !hook;
  if (hook) {
    const counts = `${hook.delivered} delivered, ${hook.failed} failed, ${hook.pending} pending`;
    $("webhook").textContent = `Webhook ${hook.url}: ${hook.refused ? `refused: ${hook.refused}` : counts}`;
  }
}

// Where a PENDING job stands in its pool's queue, in the words the CLI uses
// (workflows.admission.place_in_line): "12th of 40 for pool gpu, about 3 min".
function placeInLine(admission) {
  if (admission && admission.held === "budget") {
    // Held by its tenant's daily budget: "held: over budget until 00:00 UTC".
    const at = admission.resets_at ? new Date(admission.resets_at) : null;
    if (!at) return "held: over budget";
    const clock = at.toISOString().slice(11, at.getUTCSeconds() ? 19 : 16);
    return `held: over budget until ${clock} UTC`;
  }
  if (!admission || admission.granted || !admission.pool) return null;
  const position = admission.position;
  let place = "waiting";
  if (position != null) {
    const teens = position % 100 >= 10 && position % 100 <= 20;
    place = `${position}${teens ? "th" : { 1: "st", 2: "nd", 3: "rd" }[position % 10] || "th"}`;
  }
  const line = `${place} of ${admission.waiting || "?"} for pool ${admission.pool}`;
  return admission.eta_s == null ? line : `${line}, about ${duration(admission.eta_s)}`;
}

function duration(seconds) {
  if (seconds < 90) return `${Math.round(seconds)} s`;
  if (seconds < 5400) return `${Math.round(seconds / 60)} min`;
  return `${(seconds / 3600).toFixed(1)} h`;
}

function renderDecision(status) {
  const decision = status.state === "NEEDS_DECISION" ? status.decision : null;
  $("decision").hidden = !decision;
  if (!decision) return;
  $("decision-reason").textContent = decision.reason;
  const options = Object.entries(decision.options || {}).map(([choice, effect]) => {
    const item = document.createElement("li");
    item.textContent = `${choice}: ${effect}`;
    return item;
  });
  $("decision-options").replaceChildren(...options);
  $("resume").hidden = !decision.reattach_possible;
  $("resubmit").hidden = !Object.keys(decision.options || {}).some((c) => c.includes("resubmit"));
}

function addOutput(run, artifact) {
  const known = run.outputs.has(artifact.key);
  run.outputs.set(artifact.key, artifact); // a later copy carries a fresher URL
  if (known) return;
  const item = document.createElement("li");
  item.textContent = `${artifact.key} (${artifact.content_type}, ${artifact.size} bytes)`;
  $("outputs").append(item);
}

// The final outputs, from their presigned URLs: the images shown, anything else linked.
function renderGallery(run) {
  const figures = [...run.outputs.values()].map((artifact) => {
    const figure = document.createElement("figure");
    const caption = document.createElement("figcaption");
    caption.textContent = artifact.key;
    if (!artifact.url) {
      caption.textContent += " (no URL)";
    } else if ((artifact.content_type || "").startsWith("image/")) {
      const img = document.createElement("img");
      img.src = artifact.url;
      img.alt = artifact.key;
      img.addEventListener("error", () => {
        caption.textContent = `${artifact.key}: did not load (its link may have expired: reload the page)`;
      });
      figure.append(img);
    } else {
      const link = document.createElement("a");
      link.href = artifact.url;
      link.textContent = "download";
      figure.append(link);
    }
    figure.append(caption);
    return figure;
  });
  $("gallery").replaceChildren(...figures);
}

function showJobError(text) {
  $("job-error").textContent = text;
  $("job-error").hidden = !text;
}

function showConnection(kind, detail = null, waitMs = null) {
  connectionLine($("connection"), $("retry"), "job", kind, detail, waitMs);
}

function showBatchConnection(kind, detail = null, waitMs = null) {
  connectionLine($("batch-connection"), $("batch-retry"), "batch", kind, detail, waitMs);
}

function connectionLine(line, retry, noun, kind, detail, waitMs) {
  const seconds = waitMs == null ? "" : ` Next try in ${Math.ceil(waitMs / 1000)} s.`;
  const texts = {
    idle: "",
    connecting: "Connecting…",
    live: `Live: following the ${noun}'s events.`,
    reconnecting: `reconnecting… the gateway's event stream dropped; polling the ${noun} meanwhile.${seconds}`,
    lost:
      `contact lost: no answer from the gateway for over ${RETRY.contactHorizonMs / 1000} s. ` +
      `The ${noun} itself goes on server-side; this page keeps trying.${seconds}`,
    ended: `The ${noun} has ended; no longer following.`,
    stopped: "Not following.",
  };
  line.dataset.connection = kind;
  line.textContent = detail ? `${texts[kind]} ${detail}` : texts[kind];
  retry.hidden = !(kind === "reconnecting" || kind === "lost" || kind === "stopped");
}

// --- wiring -----------------------------------------------------------------------------

// What the address names: `#job=<id>` or `#batch=<id>` (each link reopens it anywhere).
function fromHash(name) {
  const match = new RegExp(`^#${name}=(.+)$`).exec(location.hash);
  return match ? decodeURIComponent(match[1]) : null;
}

function followHash() {
  const jobId = fromHash("job");
  const batchId = fromHash("batch");
  if (jobId) startFollowing(jobId);
  else if (batchId) startFollowingBatch(batchId);
}

function retryNow() {
  if (!job) return;
  if (job.stopped && !job.ended) startFollowing(job.id);
  else job.wake?.();
}

function retryBatchNow() {
  if (!batch) return;
  if (batch.stopped && !batch.ended) startFollowingBatch(batch.id);
  else batch.wake?.();
}

async function main() {
  $("api-key").value = localStorage.getItem(KEY_STORAGE) || "";
  $("api-key").addEventListener("change", () => {
    localStorage.setItem(KEY_STORAGE, apiKey());
    // Either stopped for want of a key.
    if (job?.stopped && !job.ended) retryNow();
    if (batch?.stopped && !batch.ended) retryBatchNow();
  });
  $("load-example").addEventListener("click", () => {
    if (exampleGraph) $("graph").value = JSON.stringify(exampleGraph, null, 2);
    else showSubmitError("The gateway offers no example graph.");
  });
  $("submit").addEventListener("click", submit);
  $("count").addEventListener("input", countChanged);
  $("count").addEventListener("change", countChanged);
  countChanged(); // a count the browser kept over a reload
  $("retry").addEventListener("click", retryNow);
  $("cancel").addEventListener("click", (e) =>
    control(e.target, "/cancel", { reason: "cancelled from the browser page" }),
  );
  $("resume").addEventListener("click", (e) => control(e.target, "/resume", { resubmit: false }));
  $("resubmit").addEventListener("click", (e) => control(e.target, "/resume", { resubmit: true }));
  $("batch-retry").addEventListener("click", retryBatchNow);
  $("batch-cancel").addEventListener("click", (e) => cancelBatch(e.target));
  window.addEventListener("hashchange", followHash);
  await loadConfig();
  followHash();
}

main();
