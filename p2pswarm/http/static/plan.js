// The plan page. It never plans by itself: every change of a field or a card asks the
// leader's planner again (POST /api/models/plan or /api/jobs/plan) and draws the answer.
// "Load this plan" / "Start training" send the shown plan's plan_id, unless a field was
// changed after that plan was shown: then they send the fields alone, without the pin.
"use strict";
(() => {
  const {api, link, size, count, el, params} = P2P;
  const $ = (id) => document.getElementById(id);

  const SEGMENTS = [
    ["other_programs", "other programs"], ["weights", "weights"],
    ["embeddings_head_buffers", "embeddings, head, buffers"], ["kv_cache", "KV cache"],
    ["activations", "activations"], ["optimizer", "optimizer"], ["lora", "LoRA"],
    ["workspace", "workspace"], ["free", "free"], ["does_not_fit", "does not fit"],
  ];
  const OVERFLOW_ROOM = 0.5;  // room past a card's end for "does not fit", in card totals

  const kind = params.get("kind") === "train" ? "train" : "serve";
  let baseConfig = {};
  try { baseConfig = JSON.parse(params.get("config") || "{}") || {}; } catch (err) { baseConfig = {}; }

  const state = {
    exclude: new Set(params.getAll("exclude")),
    maximize: null,        // what the next plan maximizes ("speed" stays until untoggled)
    shown: null,           // the plan on screen
    shownBody: null,       // the request that made it
    shownSnapshot: null,   // the fields as they were when it was shown
    asked: 0,              // the newest plan request; older answers are dropped
  };

  // --- fields ---------------------------------------------------------------------------

  function intField(id) {
    const text = $(id).value.trim();
    if (text === "") return null;
    const n = Number(text);
    return Number.isInteger(n) ? n : text;  // the planner says what is wrong with text
  }

  function jobConfig() {
    const config = Object.assign({}, baseConfig);
    config.model = $("t-model").value;
    for (const key of ["seq_len", "micro_batch", "micro_batches", "steps"]) {
      const value = intField(key);
      if (value === null) delete config[key]; else config[key] = value;
    }
    config.mode = $("mode").value;
    config.optimizer = Object.assign({}, baseConfig.optimizer || {}, {name: $("optimizer").value});
    if (config.mode === "lora") {
      const rank = intField("lora_rank");
      config.lora = Object.assign({}, baseConfig.lora || {}, rank === null ? {} : {rank});
    } else {
      delete config.lora;
    }
    const replicas = $("replicas").value.trim();
    config.replicas = replicas === "" || replicas === "auto" ? "auto"
      : (Number.isInteger(Number(replicas)) ? Number(replicas) : replicas);
    return config;
  }

  function planBody(maximize) {
    const exclude_cards = [...state.exclude].sort();
    if (kind === "train") {
      const body = {config: jobConfig(), exclude_cards};
      if (maximize) body.maximize = maximize;
      return body;
    }
    const body = {model: $("model").value, kv_dtype: $("kv_dtype").value,
                  weights_dtype: $("weights_dtype").value, exclude_cards};
    const context = intField("context"), stages = intField("stages");
    if (context !== null) body.context = context;
    if (stages !== null) body.stages = stages;
    if (maximize) body.maximize = maximize;
    return body;
  }

  // What the person has asked for, to tell whether the shown plan is still theirs.
  function snapshot() {
    const values = {};
    for (const node of document.querySelectorAll("#fields input, #fields select")) {
      if (!node.closest("fieldset").hidden) values[node.id] = node.value;
    }
    return JSON.stringify({values, exclude: [...state.exclude].sort(), maximize: state.maximize});
  }

  function setFieldsFrom(plan) {
    const r = plan.request || {};
    if (kind === "serve") {
      if (r.context) $("context").value = r.context;
      if (r.kv_dtype) $("kv_dtype").value = r.kv_dtype;
      if (r.weights_dtype) $("weights_dtype").value = r.weights_dtype;
    } else if (r.seq_len) {
      $("seq_len").value = r.seq_len;
    }
  }

  // --- asking the planner -----------------------------------------------------------------

  async function replan(maximize) {
    const asked = ++state.asked;
    const body = planBody(maximize === undefined ? state.maximize : maximize);
    document.body.setAttribute("aria-busy", "true");
    const path = kind === "train" ? "/api/jobs/plan" : "/api/models/plan";
    const answer = await api("POST", path, body);
    if (asked !== state.asked) return null;  // a newer request is on its way
    document.body.removeAttribute("aria-busy");
    if (!answer.ok) {
      showError(answer.data.error);
      return null;
    }
    hideMessage();
    show(answer.data, body);
    return answer.data;
  }

  function show(plan, body) {
    setFieldsFrom(plan);
    state.shown = plan;
    state.shownBody = body;
    render(plan);
    state.shownSnapshot = snapshot();
    updatePin();
  }

  // --- drawing --------------------------------------------------------------------------

  function cardKey(card) {
    return card.fellow_id + ":" + (card.kind === "cpu" ? "cpu" : card.index);
  }

  function cardLabel(card) {
    return card.kind === "cpu" ? card.name + " (CPU)" : card.name + " #" + card.index;
  }

  function layersText(card) {
    return card.layers ? card.layers[0] + "–" + (card.layers[1] - 1) : "—";
  }

  // a used card's stage: its weights dtype and why (the plan's stages say)
  function stageOf(card) {
    if (!state.shown || card.stage === null || card.stage === undefined) return null;
    return (state.shown.stages || []).find((s) => s.stage === card.stage) || null;
  }

  function render(plan) {
    const limit = plan.layout.limit;
    $("limit").textContent = limit.sentence;
    $("limit").classList.toggle("no-fit", !plan.fits);
    $("chart").setAttribute("aria-label", limit.sentence);
    $("summary").textContent = plan.summary;
    $("title").textContent = (kind === "train" ? "Training plan: " : "Plan: ") + plan.model.name;
    document.title = (kind === "train" ? "Training plan " : "Plan ") + plan.model.name + " · p2pswarm";
    renderStrip(plan);
    renderChart(plan);
    renderTable(plan);
    const submit = $("submit");
    submit.disabled = !plan.fits;
    submit.dataset.planId = plan.plan_id;
  }

  function renderStrip(plan) {
    const strip = $("strip");
    const total = plan.model.layers || 1;
    strip.replaceChildren(...plan.layout.strip.map((s) => {
      const text = s.layers[0] + "–" + (s.layers[1] - 1) + " " + s.fellow + " " + s.card +
        (s.weights_dtype ? " · " + s.weights_dtype : "");
      return el("div", {class: "stage", title: "stage " + s.stage + ": layers " + text,
                        style: "flex: " + (s.layers[1] - s.layers[0]) / total + " 1 0"}, text);
    }));
    if (!plan.layout.strip.length) strip.append(el("div", {class: "stage", style: "flex:1;background:#8c959f"}, "no stages"));
  }

  function renderChart(plan) {
    let room = 0;
    for (const card of plan.cards) {
      room = Math.max(room, Math.min(OVERFLOW_ROOM, card.segments.does_not_fit / card.total_bytes));
    }
    const groups = [];
    let group = null;
    for (const card of plan.cards) {
      if (!group || group.id !== card.fellow_id) {
        group = {id: card.fellow_id, name: card.fellow, cards: []};
        groups.push(group);
      }
      group.cards.push(card);
    }
    $("chart").replaceChildren(...groups.map((g) => el("div", {class: "fellow"},
      el("h3", {}, g.name),
      g.cards.map((card) => cardRow(card, room)))));
  }

  function cardRow(card, room) {
    const mem = el("div", {class: "mem", style: "width:" + (100 / (1 + room)) + "%",
                           "data-total-bytes": card.total_bytes});
    let at = 0;
    for (const [name, label] of SEGMENTS) {
      const bytes = card.segments[name] || 0;
      if (bytes <= 0) continue;
      let shown = bytes;
      const clipped = name === "does_not_fit" && bytes / card.total_bytes > room + 1e-9;
      if (clipped) shown = room * card.total_bytes;
      mem.append(el("div", {
        class: "seg " + name + (clipped ? " clipped" : ""), "data-segment": name,
        "data-bytes": bytes, title: label + ": " + size(bytes),
        // "does not fit" starts at the card's end: the claims before it run past that far
        style: "left:" + (name === "does_not_fit" ? 100 : at / card.total_bytes * 100) +
               "%;width:" + (shown / card.total_bytes * 100) + "%",
      }));
      at += name === "does_not_fit" ? 0 : bytes;
    }
    const stage = stageOf(card);
    const where = card.used ? "layers " + layersText(card) +
      (stage && stage.weights_dtype ? " · " + stage.weights_dtype : "") : (card.reason || "not used");
    return el("div", {class: "card" + (card.used ? "" : " unused"), "data-card": cardKey(card)},
      el("div", {class: "name"}, cardLabel(card) + " · " + size(card.total_bytes), el("small", {}, where)),
      el("div", {class: "track"}, mem));
  }

  function segmentsText(card) {
    return SEGMENTS.filter(([name]) => (card.segments[name] || 0) > 0)
      .map(([name, label]) => label + " " + size(card.segments[name])).join(" · ");
  }

  function renderTable(plan) {
    const rows = plan.cards.map((card) => {
      const key = cardKey(card);
      const box = el("input", {type: "checkbox", "data-card": key,
        "aria-label": "Use " + card.fellow + "'s " + cardLabel(card),
        checked: !state.exclude.has(key), onchange: (event) => {
          if (event.target.checked) state.exclude.delete(key); else state.exclude.add(key);
          replan();
        }});
      return el("tr", {class: card.used ? "" : "unused", "data-card": key},
        el("td", {}, box), el("td", {}, card.fellow), el("td", {}, cardLabel(card)),
        el("td", {}, layersText(card)), el("td", {class: "segments"}, segmentsText(card)),
        el("td", {class: "reason"}, card.used ? "used, stage " + card.stage +
          (stageOf(card) && stageOf(card).dtype_reason ? " · " + stageOf(card).dtype_reason : "")
          : card.reason || ""));
    });
    // the rows are drawn anew: a Use box that had the focus (ticked from the keyboard)
    // gets it back on its new self, so focus does not fall to the page body
    const had = document.activeElement;
    const focusKey = had && had.matches("#cards input[data-card]") ? had.dataset.card : null;
    const body = document.querySelector("#cards tbody");
    body.replaceChildren(...rows);
    if (focusKey !== null) {
      const again = rows.map((row) => row.querySelector("input[data-card]"))
        .find((input) => input && input.dataset.card === focusKey);
      if (again) again.focus();
    }
  }

  function renderLegend() {
    $("legend").replaceChildren(...SEGMENTS.map(([name, label]) => el("li", {},
      el("span", {class: "swatch seg " + name, style: "position:static"}), label)));
  }

  // --- messages ---------------------------------------------------------------------------

  function showMessage(kindClass, ...nodes) {
    const box = $("message");
    box.className = "message " + kindClass;
    box.replaceChildren(...nodes);
    box.hidden = false;
  }

  function hideMessage() { $("message").hidden = true; }

  function showError(error) {
    showMessage("error", el("strong", {}, (error.code || "error") + ": "), error.message || "");
  }

  function updatePin() {
    const pinned = state.shown && snapshot() === state.shownSnapshot;
    $("pin").textContent = !state.shown ? "" : pinned
      ? "Sends plan " + state.shown.plan_id + ": it starts exactly as shown, or is refused."
      : "A field changed since the plan was shown: sends the fields without a plan_id.";
  }

  // --- submitting -------------------------------------------------------------------------

  async function submit() {
    const pinned = state.shown && snapshot() === state.shownSnapshot;
    let body;
    if (kind === "train") {
      const source = pinned ? state.shownBody : planBody(state.maximize);
      body = {config: source.config};
      if (source.exclude_cards && source.exclude_cards.length) body.exclude_cards = source.exclude_cards;
    } else {
      body = Object.assign({}, pinned ? state.shownBody : planBody(state.maximize));
    }
    if (pinned) body.plan_id = state.shown.plan_id;
    $("submit").disabled = true;
    showMessage("info", kind === "train" ? "Starting the training run…" : "Loading…");
    const answer = await api("POST", kind === "train" ? "/api/jobs" : "/api/models/load", body);
    $("submit").disabled = !(state.shown && state.shown.fits);
    if (answer.ok) {
      const r = answer.data || {};
      showMessage("done", kind === "train"
        ? "Training run " + (r.job_id || "") + " started (plan " + (r.plan_id || body.plan_id || "") + ")."
        : "Loaded plan " + (r.plan_id || "") + ": " + ((r.stages || []).length) + " stages.");
      return;
    }
    const error = answer.data.error;
    if (error.code === "plan-changed") {
      const changed = error.changed && error.changed.length ? error.changed : ["the swarm differs from when the plan was shown"];
      if (error.plan) show(error.plan, kind === "train" ? {config: body.config, exclude_cards: body.exclude_cards || []} : stripPin(body));
      showMessage("refused",
        el("strong", {}, "Refused: the plan changed. "),
        "Nothing was " + (kind === "train" ? "started" : "loaded") + ". Plan " + (error.expected_plan_id || body.plan_id) +
        " no longer holds; the swarm now gives " + (error.new_plan_id || (error.plan && error.plan.plan_id) || "another plan") +
        ", shown below. What changed:",
        el("ul", {}, changed.map((line) => el("li", {}, line))));
      return;
    }
    showError(error);
  }

  function stripPin(body) {
    const copy = Object.assign({}, body);
    delete copy.plan_id;
    return copy;
  }

  // --- start ------------------------------------------------------------------------------

  async function fillModels() {
    const wanted = params.get("model") || (typeof baseConfig.model === "string" ? baseConfig.model : "");
    const answer = await api("GET", "/api/models");
    const names = answer.ok ? answer.data.models.map((m) => m.name) : [];
    if (wanted && !names.includes(wanted)) names.unshift(wanted);
    for (const id of ["model", "t-model"]) {
      $(id).replaceChildren(...names.map((n) => el("option", {value: n}, n)));
      if (wanted) $(id).value = wanted;
    }
  }

  function fillTrainFields() {
    const c = baseConfig;
    $("seq_len").value = c.seq_len ?? 128;
    $("micro_batch").value = c.micro_batch ?? "auto";
    $("micro_batches").value = c.micro_batches ?? 1;
    $("steps").value = c.steps ?? 1000;
    $("mode").value = c.mode || "full";
    $("lora_rank").value = (c.lora && c.lora.rank) ?? 16;
    $("optimizer").value = (c.optimizer && c.optimizer.name) || "adamw";
    $("replicas").value = c.replicas === undefined || c.replicas === "auto" ? "" : c.replicas;
  }

  async function start() {
    renderLegend();
    $("back").href = link("/");
    $("serve-fields").hidden = kind === "train";
    $("train-fields").hidden = kind !== "train";
    $("submit").textContent = kind === "train" ? "Start training" : "Load this plan";
    for (const key of ["context", "stages"]) if (params.get(key)) $(key).value = params.get(key);
    for (const key of ["kv_dtype", "weights_dtype"]) if (params.get(key)) $(key).value = params.get(key);
    if (kind === "train") fillTrainFields();
    await fillModels();

    $("fields").addEventListener("submit", (event) => { event.preventDefault(); replan(); });
    const loraRank = () => { $("lora_rank").disabled = $("mode").value !== "lora"; };
    loraRank();
    $("mode").addEventListener("change", loraRank);
    $("fields").addEventListener("change", (event) => {
      if (event.target.id === "context") state.maximize = state.maximize === "context" ? null : state.maximize;
      replan();
    });
    $("fields").addEventListener("input", updatePin);
    $("maximize-context").addEventListener("click", () => replan("context"));
    $("fastest").addEventListener("click", () => {
      state.maximize = state.maximize === "speed" ? null : "speed";
      $("fastest").setAttribute("aria-pressed", String(state.maximize === "speed"));
      replan();
    });
    $("maximize-seq-len").addEventListener("click", async () => {
      // the sequence length the cards hold goes into the dialog's field, then that is planned
      const plan = await replan("seq_len");
      if (plan && plan.layout.limit.holds) {
        $("seq_len").value = plan.layout.limit.holds;
        await replan();
      }
    });
    $("submit").addEventListener("click", submit);
    await replan();
  }

  start();
})();
