// Shared by the pages: the API call (with the bearer token from ?token=), sizes, links.
"use strict";
const P2P = (() => {
  const params = new URLSearchParams(location.search);
  const token = params.get("token");

  // One JSON request; never throws for an HTTP error: {ok, status, data}.
  async function api(method, path, body) {
    const headers = {"Accept": "application/json"};
    if (body !== undefined) headers["Content-Type"] = "application/json";
    if (token) headers["Authorization"] = "Bearer " + token;
    let response;
    try {
      response = await fetch(path, {method, headers,
        body: body === undefined ? undefined : JSON.stringify(body)});
    } catch (err) {
      return {ok: false, status: 0, data: {error: {code: "unreachable",
        message: "The agent did not answer: is `p2pswarm join` still running?"}}};
    }
    let data = null;
    try { data = await response.json(); } catch (err) { data = null; }
    if (response.ok && data === null && response.status !== 204) {
      // a body cut short (the page left, the agent stopped): an error, not an empty answer
      return {ok: false, status: response.status, data: {error: {code: "cut-short",
        message: "The agent's answer was cut short: try again."}}};
    }
    if (!response.ok && !(data && data.error)) {
      data = {error: {code: "http-" + response.status,
        message: "The agent answered HTTP " + response.status + "."}};
    }
    return {ok: response.ok, status: response.status, data};
  }

  // A link to another page that keeps the token.
  function link(path, query) {
    const q = new URLSearchParams(query || {});
    if (token) q.set("token", token);
    const text = q.toString();
    return text ? path + "?" + text : path;
  }

  function size(bytes) {
    const units = [["TB", 1e12], ["GB", 1e9], ["MB", 1e6], ["kB", 1e3]];
    for (const [unit, n] of units) {
      if (Math.abs(bytes) >= n) return (bytes / n).toFixed(bytes >= 10 * n ? 1 : 2) + " " + unit;
    }
    return bytes + " B";
  }

  function count(n) { return Number(n).toLocaleString("en-US"); }

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key === "class") node.className = value;
      else if (key === "text") node.textContent = value;
      else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, value === true ? "" : value);
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  // Links between the pages keep the token: <a data-page="/swarm">.
  for (const a of document.querySelectorAll("a[data-page]")) a.href = link(a.dataset.page);

  return {api, link, size, count, el, params};
})();
