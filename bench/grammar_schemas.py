"""JSON schemas as API users send them for structured output, each with a valid instance: what
bench/grammar_engines.py compiles and decodes. 10 to 20 properties, nested objects and arrays,
enums, anyOf, string formats and patterns, bounded numbers."""

from __future__ import annotations

ADDRESS = {
    "type": "object",
    "properties": {
        "street": {"type": "string", "maxLength": 60},
        "city": {"type": "string", "maxLength": 40},
        "postcode": {"type": "string", "pattern": "^[0-9]{5}$"},
        "country": {"type": "string", "enum": ["DE", "FR", "GB", "US", "JP"]},
    },
    "required": ["street", "city", "postcode", "country"],
    "additionalProperties": False,
}

PERSON = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "format": "uuid"},
        "name": {"type": "string", "minLength": 1, "maxLength": 50},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "active": {"type": "boolean"},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
        "address": ADDRESS,
        "nickname": {"anyOf": [{"type": "string", "maxLength": 20}, {"type": "null"}]},
        "created": {"type": "string", "format": "date-time"},
        "role": {"type": "string", "enum": ["admin", "editor", "viewer"]},
        "manager_id": {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}]},
    },
    "required": ["id", "name", "age", "email", "active", "score", "tags", "address", "nickname", "created", "role",
                 "manager_id"],
    "additionalProperties": False,
}
PERSON_INSTANCE = {
    "id": "3f2b8c1e-9a4d-4e6f-8b7a-1c2d3e4f5a6b", "name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
    "active": True, "score": 0.93, "tags": ["math", "engines"],
    "address": {"street": "12 St James Square", "city": "London", "postcode": "12345", "country": "GB"},
    "nickname": None, "created": "2026-11-26T06:30:00Z", "role": "editor", "manager_id": 7,
}

ORDER = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
        "customer": {"type": "string", "maxLength": 40},
        "currency": {"type": "string", "enum": ["EUR", "USD", "GBP"]},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 10,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    "unit_price": {"type": "number", "minimum": 0},
                    "gift": {"type": "boolean"},
                },
                "required": ["sku", "quantity", "unit_price", "gift"],
                "additionalProperties": False,
            },
        },
        "shipping": ADDRESS,
        "express": {"type": "boolean"},
        "total": {"type": "number", "minimum": 0},
        "notes": {"anyOf": [{"type": "string", "maxLength": 100}, {"type": "null"}]},
        "placed": {"type": "string", "format": "date-time"},
        "status": {"type": "string", "enum": ["new", "paid", "shipped", "delivered", "cancelled"]},
    },
    "required": ["order_id", "customer", "currency", "items", "shipping", "express", "total", "notes", "placed", "status"],
    "additionalProperties": False,
}
ORDER_INSTANCE = {
    "order_id": "ORD-004217", "customer": "Grace Hopper", "currency": "EUR",
    "items": [{"sku": "ABC-1234", "quantity": 2, "unit_price": 9.5, "gift": False},
              {"sku": "XYZ-0042", "quantity": 1, "unit_price": 120.0, "gift": True}],
    "shipping": {"street": "1 Harbour Road", "city": "Hamburg", "postcode": "20457", "country": "DE"},
    "express": True, "total": 139.0, "notes": "leave at the door", "placed": "2026-11-25T18:04:11Z", "status": "paid",
}

CLASSIFICATION = {
    "type": "object",
    "properties": {
        "label": {"type": "string", "enum": ["positive", "negative", "neutral", "mixed"]},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "topics": {"type": "array", "items": {"type": "string", "enum": ["price", "quality", "delivery", "support"]},
                   "maxItems": 4},
        "language": {"type": "string", "enum": ["en", "de", "fr", "es"]},
        "toxic": {"type": "boolean"},
        "summary": {"type": "string", "maxLength": 120},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "reply_needed": {"type": "boolean"},
        "keywords": {"type": "array", "items": {"type": "string", "maxLength": 15}, "maxItems": 6},
        "source": {"anyOf": [{"type": "string", "enum": ["email", "chat", "review"]}, {"type": "null"}]},
    },
    "required": ["label", "confidence", "topics", "language", "toxic", "summary", "rating", "reply_needed", "keywords",
                 "source"],
    "additionalProperties": False,
}
CLASSIFICATION_INSTANCE = {
    "label": "mixed", "confidence": 0.71, "topics": ["price", "delivery"], "language": "en", "toxic": False,
    "summary": "Good product, slow delivery, price a little high.", "rating": 3, "reply_needed": True,
    "keywords": ["slow", "price"], "source": "review",
}

SETTINGS = {
    "type": "object",
    "properties": {
        **{f"flag_{i}": {"type": "boolean"} for i in range(6)},
        **{f"limit_{i}": {"type": "integer", "minimum": 0, "maximum": 10000} for i in range(6)},
        **{f"ratio_{i}": {"type": "number", "minimum": 0, "maximum": 1} for i in range(4)},
        "mode": {"type": "string", "enum": ["fast", "balanced", "exact"]},
        "name": {"type": "string", "maxLength": 30},
        "owner": {"type": "string", "format": "email"},
        "region": {"type": "string", "enum": ["eu-west", "us-east", "ap-south"]},
    },
    "additionalProperties": False,
}
SETTINGS["required"] = list(SETTINGS["properties"])
SETTINGS_INSTANCE = {
    **{f"flag_{i}": i % 2 == 0 for i in range(6)},
    **{f"limit_{i}": 100 * (i + 1) for i in range(6)},
    **{f"ratio_{i}": round(0.2 * (i + 1), 1) for i in range(4)},
    "mode": "balanced", "name": "batch settings", "owner": "ops@example.com", "region": "eu-west",
}

SCHEMAS: list[tuple[str, dict, dict]] = [
    ("person", PERSON, PERSON_INSTANCE),
    ("order", ORDER, ORDER_INSTANCE),
    ("classification", CLASSIFICATION, CLASSIFICATION_INSTANCE),
    ("settings", SETTINGS, SETTINGS_INSTANCE),
]
