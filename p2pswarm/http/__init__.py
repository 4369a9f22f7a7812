"""The agent's HTTP server: JSON API, pages, OpenAI-compatible endpoint (see app.py)."""

from p2pswarm.http.app import DEFAULT_HTTP, HttpApp, HttpSettings, http_settings, serve_http

__all__ = ["DEFAULT_HTTP", "HttpApp", "HttpSettings", "http_settings", "serve_http"]
