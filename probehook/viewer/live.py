"""The live page ``probehook serve --ui`` serves at ``/probehook/ui``: a chat box whose reply
is painted token by token as its streamed chunks arrive, through the server's own
``/v1/chat/completions`` (the ``probehook`` body object and all), with the viewer's colours,
selector and panel. Self-contained: its CSS and scripts inline, nothing fetched but the
server's own routes. No vLLM.
"""

from __future__ import annotations

from probehook.viewer.page import _static

ROUTE = "/probehook/ui"


def live_page() -> str:
    """The page's HTML."""
    return (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>probehook live</title>'
        f"<style>{_static('view.css')}</style></head><body>"
        '<div class="ph-view ph-live"><div class="ph-request">'
        '<div class="ph-title">probehook live</div>'
        '<div class="ph-controls"><label hidden>API key <input id="ph-key" type="password" '
        'size="30"></label><textarea id="ph-message" rows="3" cols="60"></textarea>'
        '<div id="ph-choices"></div>'
        'steering scale <input id="ph-scale" type="number" value="1" step="any"> '
        'max tokens <input id="ph-max" type="number" value="64" min="1"><br>'
        '<input id="ph-extra" size="60" placeholder=\'more "probehook" options, JSON: '
        '{"monitors": [...], "clamp": {...}}\'> '
        '<input id="ph-labels" size="40" placeholder=\'labels of SAE features or other '
        "entries, JSON: "
        '{"res3": {"320": "false statement"}}\'><br>'
        '<button id="ph-send">send</button> colour by <select class="ph-series"></select></div>'
        '<div class="ph-tokens" id="ph-reply"></div>'
        '<div class="ph-marks" id="ph-status"></div>'
        '<div class="ph-panel">point at a token</div></div></div>'
        f"<script>{_static('view.js')}</script><script>{_static('live.js')}</script>"
        "</body></html>\n"
    )
