"""Request bodies in ``/openapi.json`` for routes that read their body themselves (they take a
raw ``Request``, so FastAPI documents none): the OpenAI and TEI routes."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel


def request_body(document: dict[str, Any], model: type[BaseModel], prefix: str) -> dict[str, Any]:
    """The OpenAPI ``requestBody`` of ``model``; its schemas go into the document's
    components, named ``<prefix><Model>`` so that none replaces another protocol's."""
    template = f"#/components/schemas/{prefix}{{model}}"
    schema = model.model_json_schema(ref_template=template)
    components = document.setdefault("components", {}).setdefault("schemas", {})
    for name, definition in {**schema.pop("$defs", {}), model.__name__: schema}.items():
        components[prefix + name] = definition
    reference = {"$ref": template.format(model=model.__name__)}
    return {"required": True, "content": {"application/json": {"schema": reference}}}


def publish_request_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]], prefix: str) -> None:
    """Document the bodies of ``bodies`` (path -> model, of ``POST`` routes) in /openapi.json,
    when the document is first asked for: the JSON schemas take tens of milliseconds to build,
    which start-up need not spend."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = build()
            for path, model in bodies.items():
                if operation := document["paths"].get(path, {}).get("post"):
                    operation["requestBody"] = request_body(document, model, prefix)
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]
