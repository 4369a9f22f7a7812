"""Serving's control requests from plain maps: made at the control API's edge
(``p2pswarm.control.serving_requests``); named here too for the rooms that register ops."""

from __future__ import annotations

from p2pswarm.control.serving_requests import (
    chat_request,
    generate_request,
    load_cancel_request,
    load_move_request,
    load_request,
    loads_request,
    unload_request,
)

__all__ = ["chat_request", "generate_request", "load_cancel_request", "load_move_request",
           "load_request", "loads_request", "unload_request"]
