// The chat page of `localspec serve`: a conversation streamed from the server's own
// /v1/chat/completions, each reply's tokens shaded by where they came from, and a live panel read
// from /metrics. Plain JavaScript, no dependencies, nothing fetched from anywhere but this server.
//
// Every request asks for localspec's report ("speculative": {"sources": true}): each chunk then
// carries its text cut at its tokens as [piece, source] pairs (source: "draft", "lookup" or
// "oracle"), and the last one the reply's figures. Clients that do not ask never see it.
"use strict";

const KEY_STORAGE = "localspec.apiKey"; // session storage: gone when the tab closes, never sent elsewhere
const LIVE_EVERY_MS = 2000;
const SOURCE_NAMES = {draft: "draft model", lookup: "prompt lookup", oracle: "oracle"};

const $ = (id) => document.getElementById(id);

const chat = {
  messages: [], // the conversation as the server gets it: {role, content}, the system prompt apart
  running: null, // the AbortController of the reply being streamed
};

// ---------------------------------------------------------------- talking to the server

function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE) || "";
}

function authHeaders() {
  const key = apiKey();
  return key ? {Authorization: `Bearer ${key}`} : {};
}

// An error response in one line; the server answers in OpenAI's shape {"error": {"message", ...}}
async function errorText(response) {
  let message = response.statusText;
  try {
    message = (await response.json()).error.message;
  } catch (e) {
    // not an OpenAI error body: the status says enough
  }
  return `${response.status}: ${message}`;
}

// A 401 means the server has an API key: show the field for it
function checkKey(response) {
  if (response.status === 401) $("key-box").hidden = false;
}

// The data of each server-sent event of a streamed response: parsed JSON, or the string "[DONE]"
async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (line.startsWith("data: ")) {
          const data = line.slice("data: ".length);
          yield data === "[DONE]" ? data : JSON.parse(data);
        }
      }
    }
  }
}

// The request for the next reply, with the settings as they are now
function replyRequest() {
  const system = $("system").value.trim();
  const request = {
    messages: (system ? [{role: "system", content: system}] : []).concat(chat.messages),
    stream: true,
    speculative: {enabled: $("speculative").checked, sources: true},
  };
  const temperature = parseFloat($("temperature").value);
  if (!Number.isNaN(temperature)) request.temperature = temperature;
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (maxTokens > 0) request.max_tokens = maxTokens;
  const draftMax = parseInt($("draft-max").value, 10);
  if (!Number.isNaN(draftMax)) request.speculative.draft_max = draftMax;
  return request;
}

// ---------------------------------------------------------------- the conversation on the page

// Run `change` (which adds to the conversation) and keep following its end, if the reader was there
function following(change) {
  const box = $("messages");
  const atEnd = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
  change();
  if (atEnd) box.scrollTop = box.scrollHeight;
}

function addMessage(role, text) {
  const view = document.createElement("div");
  view.className = `message ${role}`;
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  view.append(body);
  following(() => $("messages").append(view));
  return view;
}

function addPiece(view, piece, source) {
  const span = document.createElement("span");
  span.className = `tok ${source}`;
  span.title = SOURCE_NAMES[source];
  span.textContent = piece;
  view.querySelector(".text").append(span);
}

function addLine(view, className, text) {
  const line = document.createElement("p");
  line.className = className;
  line.textContent = text;
  following(() => view.append(line));
}

function percent(x) {
  return `${Math.round(100 * x)}%`;
}

// The line under a reply: what `localspec chat` prints after a reply and shows in /stats
function figuresText(f, finish, speculating) {
  const parts = [`${f.completion_tokens} tokens`, `${f.tokens_per_second.toFixed(1)} tok/s`];
  if (!speculating) {
    parts.push("oracle alone");
  } else if (f.drafted) {
    parts.push(`acceptance ${percent(f.acceptance_rate)}`, `mean accepted length ${f.mean_accepted_length.toFixed(2)}`);
    if (f.speedup !== null) parts.push(`speedup ~${f.speedup.toFixed(2)}x vs the oracle alone (estimate)`);
  } else {
    parts.push("nothing drafted");
  }
  if (finish === "length") parts.push("stopped at max tokens");
  return parts.join(" · ");
}

function setStatus(text) {
  $("status").textContent = text;
}

function updateButtons() {
  const running = chat.running !== null;
  $("send").disabled = running;
  $("stop").disabled = !running;
  $("regenerate").disabled = running || chat.messages.length === 0;
}

// Stream a reply to the conversation as it stands. Returns whether any text came (a stopped reply
// keeps what it got, as `localspec chat` does).
async function reply() {
  const conversation = chat.messages; // New chat while this streams starts another: this one keeps the reply
  const request = replyRequest();
  const view = addMessage("assistant", "");
  const controller = new AbortController();
  chat.running = controller;
  updateButtons();
  setStatus("");
  let text = "";
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: {"Content-Type": "application/json", ...authHeaders()},
      body: JSON.stringify(request),
      signal: controller.signal,
    });
    if (!response.ok) {
      checkKey(response);
      setStatus(await errorText(response));
    } else {
      for await (const data of events(response)) {
        if (data === "[DONE]") break;
        if (data.error) { // the server failed mid-stream (or is shutting down): what came stays
          if (text) addLine(view, "error", data.error.message);
          else setStatus(data.error.message);
          break;
        }
        for (const choice of data.choices) {
          const report = choice.speculative; // asked for: on every chunk with text or a finish
          if (!report) continue;
          following(() => {
            for (const [piece, source] of report.sources) {
              addPiece(view, piece, source);
              text += piece;
            }
          });
          if (report.figures) {
            addLine(view, "figures", figuresText(report.figures, choice.finish_reason, request.speculative.enabled));
          }
        }
      }
    }
  } catch (error) {
    // Stop: the aborted fetch closes the connection, and the server stops the generation at once
    if (error.name === "AbortError") {
      if (text) addLine(view, "figures", "stopped");
      else setStatus("stopped");
    } else {
      setStatus(String(error));
    }
  } finally {
    chat.running = null;
  }
  if (text) {
    conversation.push({role: "assistant", content: text});
  } else {
    view.remove();
  }
  updateButtons();
  return text !== "";
}

async function send(event) {
  event.preventDefault();
  const text = $("input").value.trim();
  if (!text || chat.running) return;
  $("input").value = "";
  const conversation = chat.messages;
  conversation.push({role: "user", content: text});
  const view = addMessage("user", text);
  if (!(await reply()) && conversation === chat.messages) {
    // nothing came back (an error, or stopped at once): the message goes back to the box
    conversation.pop();
    view.remove();
    $("input").value = text;
    updateButtons();
  }
}

// Ask again for the last message: the last reply (if any) is dropped first
function regenerate() {
  if (chat.running || chat.messages.length === 0) return;
  if (chat.messages[chat.messages.length - 1].role === "assistant") {
    chat.messages.pop();
    $("messages").lastElementChild.remove();
  }
  reply();
}

function stop() {
  if (chat.running) chat.running.abort();
}

function newChat() {
  stop();
  chat.messages = [];
  $("messages").replaceChildren();
  setStatus("");
  updateButtons();
}

// ---------------------------------------------------------------- the live panel (/metrics)

const live = {tokens: null, at: 0};

// Prometheus' text format: the unlabelled samples ("name value") are all the panel reads
function parseMetrics(text) {
  const out = {};
  for (const line of text.split("\n")) {
    const match = /^([a-zA-Z_:][\w:]*) (\S+)$/.exec(line);
    if (match) out[match[1]] = parseFloat(match[2]);
  }
  return out;
}

async function refreshLive() {
  if (document.hidden) return; // a tab nobody looks at asks for nothing
  let response;
  try {
    response = await fetch("/metrics", {headers: authHeaders()});
  } catch (error) {
    $("live").textContent = "the server does not answer";
    return;
  }
  if (!response.ok) {
    checkKey(response);
    $("live").textContent = await errorText(response);
    return;
  }
  const m = parseMetrics(await response.text());
  const now = performance.now();
  const tokens = m.localspec_tokens_generated_total;
  // tokens/s: the counter's growth since the last look
  const rate = live.tokens === null ? null : (tokens - live.tokens) / ((now - live.at) / 1000);
  live.tokens = tokens;
  live.at = now;
  const drafted = m.localspec_tokens_drafted_total > 0;
  $("live").textContent = [
    `slots ${m.localspec_slots_busy}/${m.localspec_slots} in use`,
    `running ${m.localspec_generations_running}`,
    `waiting ${m.localspec_queue_depth}`,
    `acceptance since start ${drafted ? percent(m.localspec_acceptance_rate) : "n/a"}`,
    `${rate === null ? "…" : rate.toFixed(1)} tok/s`,
  ].join(" · ");
}

// ---------------------------------------------------------------- start

async function showModel() {
  const response = await fetch("/v1/models", {headers: authHeaders()});
  checkKey(response);
  $("model").textContent = response.ok ? (await response.json()).data[0].id : "";
}

function start() {
  $("composer").addEventListener("submit", send);
  $("input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", stop);
  $("regenerate").addEventListener("click", regenerate);
  $("new-chat").addEventListener("click", newChat);
  $("api-key").value = apiKey();
  $("api-key").addEventListener("change", () => {
    sessionStorage.setItem(KEY_STORAGE, $("api-key").value.trim());
    showModel();
    refreshLive();
  });
  updateButtons();
  showModel();
  refreshLive();
  setInterval(refreshLive, LIVE_EVERY_MS);
}

start();
