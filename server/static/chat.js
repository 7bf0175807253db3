// The chat page: streams answers from this server's POST v1/chat/completions (OpenAI's SSE), keeps
// the conversation in the page and sends all of it with each message. Plain script, no build step.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const KEY = "compiled-engine-api-key"; // sessionStorage: the key lasts as long as the tab
  const history = []; // {role, content} of the turns answered so far (the system prompt apart)
  let model = null; // GET v1/models' data[0].id
  let controller = null; // the AbortController of the answer in flight, if any
  let conversation = 0; // bumped by "new conversation": an answer of an older one is not kept

  function headers() {
    const h = { "Content-Type": "application/json" };
    const key = sessionStorage.getItem(KEY);
    if (key) h.Authorization = `Bearer ${key}`;
    return h;
  }

  // The server's message of an error response ({"error": {"message": ...}}), else its status.
  async function errorMessage(response) {
    const text = await response.text();
    try {
      const message = JSON.parse(text).error.message;
      if (message) return message;
    } catch (e) {
      // not OpenAI's error shape
    }
    return `HTTP ${response.status} ${response.statusText} ${text.slice(0, 300)}`.trim();
  }

  async function loadModel() {
    let response;
    try {
      response = await fetch("v1/models", { headers: headers() });
    } catch (e) {
      $("model").textContent = `the server cannot be reached: ${e.message}`;
      return;
    }
    if (response.status === 401) {
      askKey(await errorMessage(response));
      return;
    }
    if (!response.ok) {
      $("model").textContent = await errorMessage(response);
      return;
    }
    const card = (await response.json()).data[0];
    model = card.id;
    const context = card.max_model_len ? ` · context ${card.max_model_len} tokens` : "";
    $("model").textContent = `model: ${card.id}${context}`;
    $("key-form").hidden = true;
    $("key-error").textContent = "";
    $("input").focus();
  }

  // Show the key box; the server's 401 message once a key was tried (a first visit just asks).
  function askKey(message) {
    const tried = sessionStorage.getItem(KEY) !== null;
    sessionStorage.removeItem(KEY);
    $("model").textContent = "this server requires an API key";
    $("key-error").textContent = tried ? message : "";
    $("key-form").hidden = false;
    $("api-key").value = "";
    $("api-key").focus();
  }

  function addTurn(role, text) {
    const turn = document.createElement("div");
    turn.className = `turn ${role}`;
    const who = document.createElement("div");
    who.className = "role";
    who.textContent = role === "user" ? "You" : "Assistant";
    const content = document.createElement("div");
    content.className = "content";
    content.textContent = text;
    turn.append(who, content);
    $("messages").append(turn);
    turn.scrollIntoView({ block: "end" });
    return turn;
  }

  function addLine(turn, className, text) {
    const line = document.createElement("div");
    line.className = className;
    line.textContent = text;
    if (className === "error") line.setAttribute("role", "alert");
    turn.append(line);
    turn.scrollIntoView({ block: "end" });
  }

  // The request body from the settings; null (and the reason shown) when the schema does not parse.
  function requestBody(text) {
    const body = { stream: true, stream_options: { include_usage: true } };
    if (model) body.model = model;
    const schemaText = $("schema").value.trim();
    $("schema-error").textContent = "";
    if (schemaText) {
      let schema;
      try {
        schema = JSON.parse(schemaText);
      } catch (e) {
        $("schema-error").textContent = `the JSON schema does not parse: ${e.message}`;
        return null;
      }
      if (schema === null || typeof schema !== "object" || Array.isArray(schema)) {
        $("schema-error").textContent = "the JSON schema must be a JSON object";
        return null;
      }
      body.response_format = { type: "json_schema", json_schema: { name: "answer", schema } };
    }
    const temperature = $("temperature").value.trim();
    if (temperature !== "") body.temperature = Number(temperature);
    const maxTokens = $("max-tokens").value.trim();
    if (maxTokens !== "") body.max_tokens = Number(maxTokens);
    const system = $("system").value.trim();
    const turns = history.concat([{ role: "user", content: text }]);
    body.messages = (system ? [{ role: "system", content: system }] : []).concat(turns);
    return body;
  }

  function send() {
    const text = $("input").value;
    if (controller !== null || !text.trim()) return;
    const body = requestBody(text);
    if (body === null) {
      $("schema").focus();
      return;
    }
    $("input").value = "";
    history.push({ role: "user", content: text });
    const userTurn = addTurn("user", text);
    const turn = addTurn("assistant", "");
    answer(body, userTurn, turn);
  }

  // The `data:` payloads of an SSE body, one per event.
  async function* sseData(stream) {
    const reader = stream.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) return;
        buffer += decoder.decode(value, { stream: true });
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const event = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          const data = event.split("\n").filter((l) => l.startsWith("data:"));
          if (data.length) yield data.map((l) => l.slice(5).replace(/^ /, "")).join("\n");
        }
      }
    } finally {
      reader.cancel().catch(() => {});
    }
  }

  async function answer(body, userTurn, turn) {
    const mine = conversation;
    controller = new AbortController();
    setBusy(true);
    turn.dataset.state = "streaming";
    const content = turn.querySelector(".content");
    const started = performance.now();
    let firstAt = null; // time of the first content delta
    let text = "";
    let pieces = 0;
    let usage = null;
    let finish = null;
    let outcome = "done";
    try {
      const response = await fetch("v1/chat/completions", {
        method: "POST",
        headers: headers(),
        body: JSON.stringify(body),
        signal: controller.signal,
      });
      if (!response.ok) {
        const message = await errorMessage(response);
        if (response.status === 401) askKey(message);
        throw new Error(message);
      }
      for await (const data of sseData(response.body)) {
        if (data === "[DONE]") break;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) usage = chunk.usage;
        const choice = (chunk.choices || [])[0];
        if (!choice) continue;
        const piece = choice.delta && choice.delta.content;
        if (piece) {
          if (firstAt === null) firstAt = performance.now();
          text += piece;
          pieces += 1;
          content.textContent = text;
          turn.scrollIntoView({ block: "end" });
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    } catch (e) {
      outcome = e.name === "AbortError" ? "stopped" : "error";
      if (outcome === "error") addLine(turn, "error", e.message);
    }
    const ended = performance.now();
    turn.dataset.state = outcome;
    if (mine !== conversation) {
      // cleared while it streamed: its turns are gone from the page and the history
    } else if (outcome === "error") {
      // the turn is not part of the conversation: its text goes back to the box to retry
      history.pop();
      userTurn.classList.add("failed");
      if (!$("input").value) $("input").value = body.messages[body.messages.length - 1].content;
    } else {
      history.push({ role: "assistant", content: text });
      addLine(turn, "stats", stats(outcome, started, firstAt, ended, usage, pieces, finish));
    }
    setBusy(false);
  }

  function stats(outcome, started, firstAt, ended, usage, pieces, finish) {
    const parts = outcome === "stopped" ? ["stopped"] : [];
    // without a usage chunk (stopped), the content deltas approximate the tokens
    const tokens = usage ? usage.completion_tokens : pieces;
    const approx = usage ? "" : "≈";
    if (firstAt !== null) {
      parts.push(`TTFT ${((firstAt - started) / 1000).toFixed(2)} s`);
      if (tokens > 1 && ended > firstAt) {
        const rate = (tokens - 1) / ((ended - firstAt) / 1000);
        parts.push(`${approx}${rate.toFixed(1)} tokens/s`);
      }
    }
    parts.push(`${approx}${tokens} tokens`);
    if (usage) parts.push(`prompt ${usage.prompt_tokens} tokens`);
    if (finish) parts.push(`finish: ${finish}`);
    return parts.join(" · ");
  }

  function setBusy(busy) {
    $("send").disabled = busy;
    $("stop").disabled = !busy;
    if (busy) return;
    controller = null;
    const focused = document.activeElement;
    if (!focused || focused === document.body || focused === $("stop")) $("input").focus();
  }

  function stop() {
    if (controller !== null) controller.abort();
  }

  function clear() {
    stop();
    conversation += 1;
    history.length = 0;
    $("messages").replaceChildren();
    $("input").focus();
  }

  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && controller !== null) {
      e.preventDefault();
      stop();
    }
  });
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  $("stop").addEventListener("click", stop);
  $("clear").addEventListener("click", clear);
  $("schema").addEventListener("input", () => {
    $("schema-error").textContent = "";
  });
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    sessionStorage.setItem(KEY, $("api-key").value);
    loadModel();
  });
  loadModel();
})();
