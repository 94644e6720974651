// The chat page of `localspec serve`: a conversation streamed from the server's own
// /v1/chat/completions, each reply drawn as Markdown with its tokens shaded by where they came
// from, and a live panel read from /metrics. Plain JavaScript over two libraries shipped with the
// page (vendor/: markdown-it and DOMPurify), nothing fetched from anywhere but this server.
//
// Every request asks for localspec's report ("speculative": {"sources": true}): each chunk then
// carries its text cut at its tokens as [piece, source] pairs (source: "draft", "lookup",
// "suffix" or "oracle"), and the last one the reply's figures. Clients that do not ask never see it.
"use strict";

const KEY_STORAGE = "localspec.apiKey"; // session storage: gone when the tab closes, never sent elsewhere
const LIVE_EVERY_MS = 2000;
const SOURCE_NAMES = {draft: "draft model", lookup: "prompt lookup", suffix: "suffix cache", oracle: "oracle"};

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

// ---------------------------------------------------------------- replies drawn as Markdown
//
// A reply is Markdown drawn by markdown-it with raw HTML off (a reply's "<script>" shows as text),
// and the HTML it makes goes through DOMPurify, which keeps only the tags and attributes Markdown
// makes. Each drawn character is then shaded by the token it came from: the drawn text nodes are
// read in order against the reply's text, so what Markdown's syntax takes up (`**`, `|`, a fence)
// simply carries no shading.
//
// While a reply streams it is drawn at most once a frame, block by block: markdown-it's top-level
// blocks (a paragraph, a list, a table, a code block) each from its own lines, and a block whose
// lines are the same as last time keeps what was drawn of it. Only the last block changes as text
// comes, so a long reply costs a frame little more than its last block does.

const markdown = window.markdownit({html: false, linkify: false, typographer: false, breaks: true});
markdown.disable("image"); // an image would be fetched from wherever the reply says: it shows as a link
// a link definition ("[1]: address") reaches back to links in blocks drawn before it: it shows as text
markdown.disable("reference");
markdown.core.ruler.push("align_classes", alignClasses);

const SANITIZE = {
  ALLOWED_TAGS: ["p", "br", "hr", "h1", "h2", "h3", "h4", "h5", "h6", "em", "strong", "s", "code", "pre",
                 "blockquote", "ul", "ol", "li", "a", "table", "thead", "tbody", "tr", "th", "td"],
  ALLOWED_ATTR: ["href", "title", "class", "start"],
  RETURN_DOM_FRAGMENT: true,
};
// How far past the last character matched a drawn text node may begin: the syntax between two
// (a link's address, a fence's language) is skipped, a repeat of the same text further on is not
const NEAR = 256;
const NEAR_CHAR = 8; // the same for one character, where a node is not there whole (an entity, an escape)

// Links open in a new tab, and tell the other site nothing of this page
DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A") {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
});

// Table cells' alignment as a class (align-left, align-center, align-right): markdown-it writes a
// style attribute, which the page's Content-Security-Policy refuses
function alignClasses(state) {
  for (const token of state.tokens) {
    const style = token.attrGet("style");
    if (style && style.startsWith("text-align:")) {
      token.attrs = token.attrs.filter(([name]) => name !== "style");
      token.attrJoin("class", `align-${style.slice("text-align:".length)}`);
    }
  }
}

function tokenSpan(text, source) {
  const span = document.createElement("span");
  span.className = `tok ${source}`;
  span.title = SOURCE_NAMES[source];
  span.textContent = text;
  return span;
}

// Where each character of `drawn` (a text node's) is in `text`, from `from` on: all at once where
// it is there unchanged, else one by one; -1 for one Markdown made (an entity's character)
function locate(drawn, text, from) {
  const found = text.slice(from, from + NEAR + drawn.length).indexOf(drawn);
  if (found >= 0) return Array.from(drawn, (_, i) => from + found + i);
  const where = [];
  for (const c of drawn.split("")) { // UTF-16 units, as the indices count
    const near = text.slice(from, from + NEAR_CHAR + 1).indexOf(c);
    where.push(near < 0 ? -1 : from + near);
    if (near >= 0) from += near + 1;
  }
  return where;
}

// Replace `node` by its runs of characters from one token, each a shaded span (unmatched ones: text)
function splitByToken(node, where, drawing) {
  const tokenAt = (i) => (where[i] < 0 ? -1 : drawing.owner[where[i]]);
  const parts = [];
  for (let start = 0, end = 1; end <= where.length; end++) {
    if (end < where.length && tokenAt(end) === tokenAt(start)) continue;
    const run = node.data.slice(start, end);
    parts.push(tokenAt(start) < 0 ? run : tokenSpan(run, drawing.pieces[tokenAt(start)][1]));
    start = end;
  }
  node.replaceWith(...parts);
}

// Shade what is drawn under `root` of the reply's text from `from` on
function shade(root, drawing, from) {
  const nodes = [];
  const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
  while (walker.nextNode()) nodes.push(walker.currentNode);
  let next = from; // the first character of the text not matched yet
  for (const node of nodes) {
    // the line breaks markdown-it puts between blocks: not the reply's, and no place for a span
    if (!node.data.trim() && !(node.parentElement && node.parentElement.closest("pre"))) continue;
    const where = locate(node.data, drawing.text, next);
    const last = where.findLast((i) => i >= 0);
    if (last !== undefined) next = last + 1;
    splitByToken(node, where, drawing);
  }
}

// Put `text` on the clipboard: the Clipboard API where the page may use it (a secure context:
// localhost or HTTPS), else the older command on a hidden text area (plain HTTP on a LAN address)
async function copy(text, button) {
  let done;
  try {
    await navigator.clipboard.writeText(text);
    done = true;
  } catch (error) {
    const area = document.createElement("textarea");
    area.className = "offscreen";
    area.value = text;
    document.body.append(area);
    area.select();
    done = document.execCommand("copy");
    area.remove();
  }
  button.textContent = done ? "Copied" : "Copy failed";
  setTimeout(() => { button.textContent = "Copy"; }, 1500);
}

// A copy button on each code block; tables in a box that scrolls sideways on a narrow screen
function decorate(root) {
  for (const pre of root.querySelectorAll("pre")) {
    const box = document.createElement("div");
    box.className = "code";
    pre.replaceWith(box);
    const button = document.createElement("button");
    button.type = "button";
    button.className = "copy";
    button.textContent = "Copy";
    button.addEventListener("click", () => copy(pre.textContent, button));
    box.append(button, pre);
  }
  for (const table of root.querySelectorAll("table")) {
    const box = document.createElement("div");
    box.className = "table";
    table.replaceWith(box);
    box.append(table);
  }
}

// markdown-it's tokens cut into its top-level blocks (each from an opening token to its closing
// one, or a single token: a fence, a rule)
function topBlocks(tokens) {
  const blocks = [];
  let start = 0;
  tokens.forEach((token, i) => {
    if (token.level === 0 && token.nesting <= 0) {
      blocks.push(tokens.slice(start, i + 1));
      start = i + 1;
    }
  });
  return blocks;
}

// Where each line of `text` begins (markdown-it counts lines as it does: \r\n, \r or \n ends one)
function lineStarts(text) {
  const starts = [0];
  for (const match of text.matchAll(/\r\n|\r|\n/g)) starts.push(match.index + match[0].length);
  return starts;
}

// The nodes of one block (its tokens) drawn: sanitized, shaded from `from`, code and tables boxed
function drawBlock(tokens, drawing, from) {
  const fragment = DOMPurify.sanitize(markdown.renderer.render(tokens, markdown.options, {}), SANITIZE);
  shade(fragment, drawing, from);
  decorate(fragment);
  return [...fragment.childNodes];
}

// Draw the reply as it stands into its body: the blocks that are as they were stay, the rest is
// drawn again
function drawReply(drawing) {
  const {text} = drawing;
  const starts = lineStarts(text);
  const blocks = topBlocks(markdown.parse(text, {})).map((tokens) => {
    const [first, end] = tokens[0].map;
    const from = starts[first];
    return {tokens, from, key: `${from}:${text.slice(from, end < starts.length ? starts[end] : text.length)}`};
  });
  let same = 0; // the blocks drawn already, as they are
  while (same < blocks.length && same < drawing.blocks.length && blocks[same].key === drawing.blocks[same].key) same++;
  for (const block of drawing.blocks.slice(same)) for (const node of block.nodes) node.remove();
  for (const block of blocks.slice(same)) {
    block.nodes = drawBlock(block.tokens, drawing, block.from);
    drawing.body.append(...block.nodes);
  }
  drawing.blocks = drawing.blocks.slice(0, same).concat(blocks.slice(same));
}

// A reply being streamed into `view`: its pieces ([text, source] pairs) so far, its text, the
// piece each character of it came from, its blocks as drawn, and the frame it is to be drawn in
function replyDrawing(view) {
  return {body: view.querySelector(".text"), pieces: [], text: "", owner: [], blocks: [], frame: 0, stale: false};
}

function drawNow(drawing) {
  cancelAnimationFrame(drawing.frame);
  drawing.frame = 0;
  if (!drawing.stale) return;
  drawing.stale = false;
  following(() => drawReply(drawing));
}

// Add `pieces` to the reply, drawn in the next frame (a hidden tab draws none: the end draws it)
function drawSoon(drawing, pieces) {
  for (const [piece, source] of pieces) {
    for (let i = 0; i < piece.length; i++) drawing.owner.push(drawing.pieces.length);
    drawing.pieces.push([piece, source]);
    drawing.text += piece;
  }
  drawing.stale = true;
  if (!drawing.frame) drawing.frame = requestAnimationFrame(() => drawNow(drawing));
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
  const drawing = replyDrawing(view);
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
          for (const [piece] of report.sources) text += piece;
          drawSoon(drawing, report.sources);
          if (report.figures) {
            drawNow(drawing);
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
    drawNow(drawing); // what came, drawn before anything is added under it
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
