// The model list: Plan opens the plan page, Load loads as the planner places it, and the
// New training run dialog shows the job's plan (or starts it) from its fields.
"use strict";
(() => {
  const {api, link, size, count, el} = P2P;
  const $ = (id) => document.getElementById(id);

  function message(kind, ...nodes) {
    const box = $("message");
    box.className = "message " + kind;
    box.replaceChildren(...nodes);
    box.hidden = false;
  }

  // 999.6 million reads 1.0B, not "1000M": the unit goes by the rounded figure
  function params(n) {
    if (n >= 0.95e9) return (n / 1e9).toFixed(1) + "B";
    if (n >= 0.95e6) return (n >= 9.95e6 ? Math.round(n / 1e6) : (n / 1e6).toFixed(1)) + "M";
    return count(n);
  }

  // A recurrent model (RWKV) has no context bound: the planner writes 2^30 tokens
  const UNBOUNDED_CONTEXT = 2 ** 30;
  function context(n) {
    return n >= UNBOUNDED_CONTEXT ? "unbounded" : count(n);
  }

  const SOURCES = {builtin: "built in", shipped: "shipped", reference: "shape only"};

  async function load(name, button) {
    button.disabled = true;
    message("info", "Loading " + name + "…");
    const answer = await api("POST", "/api/models/load", {model: name});
    button.disabled = false;
    if (answer.ok) {
      message("done", "Loaded " + name + " as plan " + answer.data.plan_id + ".");
      showLoads();
    } else {
      message("error", el("strong", {}, answer.data.error.code + ": "), answer.data.error.message);
    }
  }

  async function showModels() {
    const answer = await api("GET", "/api/models");
    const body = document.querySelector("#models tbody");
    if (!answer.ok) {
      body.replaceChildren(el("tr", {}, el("td", {colspan: 6}, answer.data.error.message)));
      return;
    }
    const models = answer.data.models;
    body.replaceChildren(...models.map((m) => {
      const loadButton = el("button", {type: "button", "aria-label": "Load " + m.name,
        title: m.weights ? "" : "Plan only: loading needs the model's directory",
        disabled: !m.weights});
      loadButton.textContent = "Load";
      loadButton.addEventListener("click", () => load(m.name, loadButton));
      return el("tr", {"data-model": m.name},
        el("th", {scope: "row"}, m.name), el("td", {title: count(m.params) + " parameters"}, params(m.params)),
        el("td", {}, m.layers),
        el("td", {}, context(m.max_context)),
        el("td", {}, SOURCES[m.source] || (m.weights ? "built in" : "shape only")),
        el("td", {class: "buttons-cell"},
          el("a", {class: "button", href: link("/plan", {model: m.name}), "aria-label": "Plan " + m.name}, "Plan"),
          loadButton));
    }));
    $("run-model").replaceChildren(...models.map((m) => el("option", {value: m.name}, m.name)));
  }

  async function showLoads() {
    const answer = await api("GET", "/api/models/loads");
    const loads = answer.ok ? (answer.data.loads || []) : [];
    $("loads").replaceChildren(...(loads.length ? loads.map((r) => el("li", {},
      (r.model && r.model.name) + " — plan " + r.plan_id + ", " + (r.stages || []).length + " stages"))
      : [el("li", {}, answer.ok ? "Nothing is loaded." : answer.data.error.message)]));
  }

  async function showStatus() {
    const answer = await api("GET", "/api/status");
    if (!answer.ok) { $("swarm").textContent = answer.data.error.message; return; }
    const s = answer.data;
    const leader = s.leader ? s.leader.name : "no leader yet";
    $("swarm").textContent = "this fellow: " + s.self.name + " · " + (s.members || []).length +
      " fellows · leader: " + leader;
  }

  // The dialog's fields as job.json.
  function jobConfig() {
    const form = new FormData($("run-form"));
    const num = (key) => Number(form.get(key));
    const batch = String(form.get("micro_batch") || "").trim();
    const config = {model: form.get("model"), seq_len: num("seq_len"),
      micro_batch: batch === "" || batch === "auto" ? "auto" : Number(batch),
      micro_batches: num("micro_batches"), steps: num("steps"), mode: form.get("mode"),
      optimizer: {name: form.get("optimizer")}};
    if (config.mode === "lora") config.lora = {rank: num("lora_rank")};
    const replicas = String(form.get("replicas") || "").trim();
    config.replicas = replicas === "" ? "auto" : Number(replicas);
    return config;
  }

  function wireDialog() {
    const dialog = $("run-dialog");
    $("new-run").addEventListener("click", () => dialog.showModal());
    $("run-cancel").addEventListener("click", () => dialog.close());
    $("run-plan").addEventListener("click", () => {
      location.href = link("/plan", {kind: "train", config: JSON.stringify(jobConfig())});
    });
    $("run-start").addEventListener("click", async () => {
      const answer = await api("POST", "/api/jobs", {config: jobConfig()});
      dialog.close();
      if (answer.ok) message("done", "Training run " + (answer.data.job_id || "") + " started.");
      else message("error", el("strong", {}, answer.data.error.code + ": "), answer.data.error.message);
    });
  }

  wireDialog();
  showModels();
  showLoads();
  showStatus();
})();
