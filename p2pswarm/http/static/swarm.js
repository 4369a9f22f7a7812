// The swarm dashboard: GET /api/swarm about once a second (never two at once), drawn as
// fellows with their cards, the leader and its term, loads with their stages and tokens/s,
// jobs with a loss curve (inline SVG), and the last events. Pause stops the polling.
"use strict";
(() => {
  const {api, size, el} = P2P;
  const $ = (id) => document.getElementById(id);
  const POLL_MS = 1000;
  const SVG = "http://www.w3.org/2000/svg";
  let paused = false;
  let timer = null;
  let asking = false;

  function ago(seconds) {
    if (seconds === null || seconds === undefined) return "never";
    if (seconds < 1) return "just now";
    if (seconds < 90) return Math.round(seconds) + " s ago";
    if (seconds < 5400) return Math.round(seconds / 60) + " min ago";
    return (seconds / 3600).toFixed(1) + " h ago";
  }

  function num(x, digits) {
    return typeof x === "number" && isFinite(x) ? x.toFixed(digits) : "–";
  }

  // One card as a bar: what others hold, what is used otherwise, and what is free.
  function cardBar(card) {
    const total = card.total_bytes || 0;
    const free = Math.min(card.free_bytes || 0, total);
    const others = (card.held_by_others || []).reduce((n, h) => n + (h.bytes || 0), 0);
    const used = Math.max(0, total - free - others);
    const pct = (b) => total > 0 ? (100 * b / total) + "%" : "0%";
    const name = card.kind === "cpu" ? (card.name || "CPU") :
      card.kind + ":" + card.index + " " + (card.name || "");
    return el("div", {class: "card"},
      el("div", {class: "name"}, name, el("small", {}, size(free) + " free of " + size(total))),
      el("div", {class: "track", role: "img",
                 "aria-label": name + ": " + size(free) + " free of " + size(total)},
        el("div", {class: "mem", style: "width:100%"},
          el("div", {class: "seg other_programs", style: "left:0;width:" + pct(others)}),
          el("div", {class: "seg used", style: "left:" + pct(others) + ";width:" + pct(used)}))));
  }

  function fellowTile(f) {
    const badges = [el("span", {class: "badge state-" + f.state, "data-role": "state"}, f.state)];
    if (f.leader) badges.push(el("span", {class: "badge leader"}, "leader"));
    if (f.self) badges.push(el("span", {class: "badge"}, "this fellow"));
    const heard = f.self ? "this fellow" : "last heard " + ago(f.last_heard_s);
    return el("article", {class: "tile", "data-fellow": f.name, "data-state": f.state,
                          "aria-label": f.name + ", " + f.state + (f.leader ? ", leader" : "")},
      el("h3", {}, f.name, ...badges),
      el("div", {class: "meta"}, heard + " · " + f.state + " for " + ago(f.in_state_s).replace(" ago", "") +
         " · " + (f.addr || "")),
      ...(f.cards.length ? f.cards.map(cardBar) : [el("div", {class: "meta"}, "no cards told yet")]));
  }

  function loadBox(load) {
    const stages = el("div", {class: "strip", "aria-label": "Stages of plan " + load.plan_id},
      ...load.stages.map((s) => el("div", {class: "stage", style: "flex:1",
        title: "stage " + s.stage + " on " + s.fellow},
        "stage " + s.stage + " · " + (s.fellow || "?") + (s.layers ? " · layers " + s.layers.join("–") : ""))));
    const moves = load.moves.length ? el("p", {class: "note"}, "Last move: " +
      (load.moves[load.moves.length - 1].why || "")) : null;
    return el("article", {class: "load", "data-plan-id": load.plan_id},
      el("h3", {}, (load.model || "load") + " · plan " + load.plan_id),
      el("div", {class: "figures"},
        el("span", {}, "Tokens/s (through this fellow): ", el("b", {"data-role": "tokens-per-s"}, num(load.tokens_per_s, 1))),
        el("span", {}, "Tokens: ", el("b", {"data-role": "tokens"}, String(load.tokens))),
        el("span", {}, "Stages: ", el("b", {}, String(load.stages.length))),
        el("span", {}, "Moves: ", el("b", {}, String(load.moves.length)))),
      stages, moves);
  }

  // The loss curve: an inline SVG polyline over the steps shown.
  function lossCurve(job) {
    const losses = job.losses || [];
    const w = 600, h = 180, pad = 34;
    const svg = document.createElementNS(SVG, "svg");
    svg.setAttribute("viewBox", "0 0 " + w + " " + h);
    svg.setAttribute("class", "curve");
    svg.setAttribute("role", "img");
    svg.setAttribute("data-points", String(losses.length));
    const last = losses.length ? losses[losses.length - 1] : null;
    svg.setAttribute("aria-label", "Loss over " + losses.length + " steps" +
                     (last !== null ? ", now " + last.toFixed(4) : ""));
    const add = (tag, attrs, text) => {
      const node = document.createElementNS(SVG, tag);
      for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
      if (text !== undefined) node.textContent = text;
      svg.append(node);
      return node;
    };
    add("line", {class: "axis", x1: pad, y1: h - pad / 2, x2: w - 4, y2: h - pad / 2});
    add("line", {class: "axis", x1: pad, y1: 6, x2: pad, y2: h - pad / 2});
    if (!losses.length) {
      add("text", {x: w / 2, y: h / 2, "text-anchor": "middle"}, "no steps yet");
      return svg;
    }
    const lo = Math.min(...losses), hi = Math.max(...losses);
    const span = hi - lo || 1;
    const x = (i) => pad + (losses.length === 1 ? 0 : (w - pad - 8) * i / (losses.length - 1));
    const y = (v) => 8 + (h - pad / 2 - 14) * (1 - (v - lo) / span);
    const points = losses.map((v, i) => x(i).toFixed(1) + "," + y(v).toFixed(1)).join(" ");
    add("polyline", {class: "line", points});
    add("text", {x: 2, y: 14}, hi.toFixed(2));
    add("text", {x: 2, y: h - pad / 2}, lo.toFixed(2));
    add("text", {x: pad, y: h - 3}, "step " + job.losses_from_step);
    add("text", {x: w - 4, y: h - 3, "text-anchor": "end"},
        "step " + (job.losses_from_step + losses.length - 1));
    return svg;
  }

  function jobBox(job) {
    const replicas = el("table", {},
      el("thead", {}, el("tr", {}, el("th", {scope: "col"}, "Replica"), el("th", {scope: "col"}, "Local steps"),
                                el("th", {scope: "col"}, "Tokens/s"))),
      el("tbody", {}, ...job.replicas.map((r) => el("tr", {"data-replica": r.replica},
        el("td", {}, r.replica), el("td", {}, r.steps === null ? "every step" : String(r.steps)), el("td", {}, num(r.tokens_per_s, 1))))));
    const rounds = job.rounds.length ? el("p", {class: "note"}, "Rounds: " + job.rounds.slice(-6).map((r) =>
      "v" + r.version + " at step " + r.step + (r.dropped && r.dropped.length ? " (dropped " + r.dropped.join(", ") + ")" : "")).join(" · ")) :
      el("p", {class: "note"}, "No sync round closed yet.");
    const checkpoint = el("p", {class: "note"}, job.checkpoint_step ?
      "Checkpoint at step " + job.checkpoint_step + (job.checkpoint ? " (" + job.checkpoint + ")" : "") +
      "; copies on " + Object.values(job.checkpoint_copies || {}).flat().filter((v, i, a) => a.indexOf(v) === i).join(", ") :
      "No checkpoint yet.");
    return el("article", {class: "job", "data-job-id": job.job_id, "data-state": job.state},
      el("h3", {}, "Job " + job.job_id + " · " + (job.model || "") + " · " + job.state),
      el("div", {class: "figures"},
        el("span", {}, "Step ", el("b", {"data-role": "step"}, job.step + " / " + job.steps)),
        el("span", {}, "Loss ", el("b", {"data-role": "loss"}, num(job.loss, 4))),
        el("span", {}, "Tokens/s ", el("b", {}, num(job.tokens_per_s, 1))),
        el("span", {}, "Sync sent ", el("b", {}, size(job.bytes_sent || 0)))),
      job.reason ? el("p", {class: "note"}, job.reason) : null,
      lossCurve(job), el("div", {class: "table-wrap"}, replicas), rounds, checkpoint,
      job.moves.length ? el("p", {class: "note"}, "Moved: " + job.moves[job.moves.length - 1]) : null);
  }

  function eventRow(e) {
    const who = e.fellow ? e.fellow + (e.term ? " (term " + e.term + ")" : "") : "";
    return el("li", {"data-kind": e.kind},
      el("span", {class: "ago"}, ago(e.ago_s)), el("span", {class: "kind"}, e.kind),
      el("span", {class: "what"}, [who, e.detail].filter(Boolean).join(": ")));
  }

  function note(id, text) {
    $(id).textContent = text || "";
    $(id).hidden = !text;
  }

  function render(doc) {
    const leader = doc.leader;
    $("leader").textContent = leader ? "Leader " + leader.name + " · term " + leader.term :
      (doc.leader_note || "no leader");
    $("leader").dataset.leader = leader ? leader.name : "";
    const present = doc.fellows.filter((f) => f.state === "alive" || f.state === "suspect").length;
    $("fellow-count").textContent = present + " of " + doc.fellows.length + " present";
    $("fellows").replaceChildren(...doc.fellows.map(fellowTile));
    note("loads-note", doc.loads_note);
    $("loads").replaceChildren(...(doc.loads.length ? doc.loads.map(loadBox) : [el("p", {class: "note"}, "None.")]));
    note("jobs-note", doc.jobs_note);
    $("jobs").replaceChildren(...(doc.jobs.length ? doc.jobs.map(jobBox) : [el("p", {class: "note"}, "None.")]));
    $("events").replaceChildren(...doc.events.map(eventRow));
    $("updated").textContent = "updated " + new Date().toLocaleTimeString();
  }

  async function poll() {
    timer = null;
    if (paused || asking) return;
    asking = true;
    const answer = await api("GET", "/api/swarm");
    asking = false;
    if (answer.ok) {
      $("message").hidden = true;
      render(answer.data);
    } else {
      $("message").textContent = answer.data.error.code + ": " + answer.data.error.message;
      $("message").hidden = false;
    }
    if (!paused) timer = setTimeout(poll, POLL_MS);
  }

  $("pause").addEventListener("click", () => {
    paused = !paused;
    $("pause").setAttribute("aria-pressed", String(paused));
    $("pause").textContent = paused ? "Resume updates" : "Pause updates";
    if (!paused && timer === null) poll();
  });
  poll();
})();
