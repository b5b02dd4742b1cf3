"""The service's API page at /docs, built from its OpenAPI schema with no script or
stylesheet from elsewhere: FastAPI's Swagger UI loads its assets from a CDN and shows a
blank page on a node without internet, where a teacher service usually runs."""

from __future__ import annotations

import html
import json
from typing import Any

STYLE = (
    "body{font-family:sans-serif;max-width:60em;margin:2em auto;padding:0 1em}"
    "h2{border-top:1px solid #ccc;padding-top:.6em}code,pre{background:#f4f4f4}"
    "pre{padding:.6em;overflow-x:auto}.m{font-weight:bold;margin-right:.5em}"
)


def render(schema: dict[str, Any]) -> str:
    """One HTML page: each operation (method, path, what it does, its body's schema and
    its answers), then every schema the operations name, and a link to /openapi.json."""
    info = schema.get("info", {})
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{_text(info.get('title', 'API'))}</title><style>{STYLE}</style></head><body>",
        f"<h1>{_text(info.get('title', 'API'))} <small>v{_text(info.get('version', ''))}</small>"
        "</h1>",
        f"<p>{_text(info.get('description', ''))}</p>",
        "<p>Machine-readable: <a href='/openapi.json'>/openapi.json</a>. Paths under /v1/ "
        "need <code>Authorization: Bearer &lt;key&gt;</code> when the server has a key.</p>",
    ]
    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            parts.append(
                f"<h2><span class='m'>{_text(method.upper())}</span><code>{_text(path)}</code></h2>"
            )
            text = operation.get("description") or operation.get("summary") or ""
            parts.append(f"<p>{_text(text)}</p>")
            body = operation.get("requestBody", {}).get("content", {}).get("application/json")
            if body:
                parts.append(f"<p>Body: {_schema_ref(body.get('schema', {}))}</p>")
            answers = [
                f"<li><b>{_text(code)}</b> {_text(answer.get('description', ''))}</li>"
                for code, answer in operation.get("responses", {}).items()
            ]
            parts.append("<ul>" + "".join(answers) + "</ul>")
    components = schema.get("components", {}).get("schemas", {})
    if components:
        parts.append("<h2>Schemas</h2>")
    for name, body in components.items():
        parts.append(f"<h3 id='{_text(name)}'>{_text(name)}</h3>")
        parts.append(f"<pre>{_text(json.dumps(body, indent=2))}</pre>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _schema_ref(schema: dict[str, Any]) -> str:
    reference = schema.get("$ref", "")
    if reference:
        name = reference.rsplit("/", 1)[-1]
        return f"<a href='#{_text(name)}'>{_text(name)}</a>"
    return f"<code>{_text(json.dumps(schema))}</code>"


def _text(value: object) -> str:
    return html.escape(str(value), quote=True)
