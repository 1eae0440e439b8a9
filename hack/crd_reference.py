#!/usr/bin/env python3
"""Render a CRD's openAPIV3Schema as a Markdown field reference (docs/reference/).

Why a script of ours: the JSON-Schema-to-Markdown generators on npm (@adobe/jsonschema2md,
wetzel) render none of Kubernetes' `x-kubernetes-*` keywords (jsonschema2md makes each CEL
rule its own "Untitled undefined type" page, without the rule or its message), and the Go
CRD generators (fybrik.io/crdoc) cannot be had here. See docs/development.md.

Every keyword of the schema is either rendered or listed in IGNORED; any other makes the
renderer fail, so a new kind of constraint in crds/ cannot vanish from the reference.
Standard library and pyyaml only.

    python hack/crd_reference.py [CRD_YAML [OUT_MD]]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Iterator

import yaml

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CRD = ROOT / "crds" / "cachewarm.dev_compilationcaches.yaml"
DEFAULT_OUT = ROOT / "docs" / "reference" / "compilationcache.md"

# Keywords rendered as "name: value" lines, in this order.
BOUNDS = [
    ("minimum", "Minimum"),
    ("exclusiveMinimum", "Exclusive minimum"),
    ("maximum", "Maximum"),
    ("exclusiveMaximum", "Exclusive maximum"),
    ("minLength", "Minimum length"),
    ("maxLength", "Maximum length"),
    ("minItems", "Minimum items"),
    ("maxItems", "Maximum items"),
    ("minProperties", "Minimum properties"),
    ("maxProperties", "Maximum properties"),
]
RENDERED = {
    "type", "format", "description", "default", "enum", "pattern", "required",
    "properties", "items", "additionalProperties", "nullable",
    "x-kubernetes-validations", "x-kubernetes-list-type", "x-kubernetes-list-map-keys",
    "x-kubernetes-preserve-unknown-fields", "x-kubernetes-int-or-string",
    "x-kubernetes-embedded-resource", "x-kubernetes-map-type",
} | {key for key, _ in BOUNDS}
# Rendered as part of another keyword: anyOf only as the int-or-string pair.
IGNORED = {"anyOf"}
# What the parent's heading says of scalar items or map values.
SCALAR_MEMBER = {"type", "format", "minLength", "maxLength", "pattern", "enum",
                 "x-kubernetes-int-or-string", "anyOf"}
RULE_KEYS = {"rule", "message", "messageExpression", "fieldPath", "reason", "optionalOldSelf"}


def code(text: str) -> str:
    """A Markdown code span that holds `text` whatever backticks it contains."""
    fence = "`"
    while fence in text:
        fence += "`"
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def prose(text: str) -> str:
    """A description as one paragraph, with the characters Markdown would eat escaped."""
    out = " ".join(text.split())
    for char in "\\`*<[":
        out = out.replace(char, "\\" + char)
    return out


def value(v: Any) -> str:
    return code(json.dumps(v, sort_keys=True))


def type_of(schema: dict[str, Any]) -> str:
    """The field's type as a reader writes it: string, []object, map[string]string."""
    if schema.get("x-kubernetes-int-or-string"):
        return "int-or-string"
    kind = schema.get("type", "")
    if kind == "array":
        return "[]" + type_of(schema.get("items", {}))
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return "map[string]" + type_of(schema["additionalProperties"])
    if not kind:
        return "any" if schema.get("x-kubernetes-preserve-unknown-fields") else "unspecified"
    return f"{kind} ({schema['format']})" if "format" in schema else kind


def check_keywords(schema: dict[str, Any], path: str) -> None:
    unknown = set(schema) - RENDERED - IGNORED
    if unknown:
        raise ValueError(f"{path or '<root>'}: schema keywords not rendered: {sorted(unknown)}")
    if "anyOf" in schema and not schema.get("x-kubernetes-int-or-string"):
        raise ValueError(f"{path or '<root>'}: anyOf is rendered only for int-or-string")
    for rule in schema.get("x-kubernetes-validations", []):
        if set(rule) - RULE_KEYS:
            raise ValueError(f"{path}: validation rule keys not rendered: {sorted(set(rule) - RULE_KEYS)}")


def fields(schema: dict[str, Any], path: str, required: bool) -> Iterator[tuple[str, dict[str, Any], bool]]:
    """(path, schema, required) for the schema and every field under it, depth first."""
    check_keywords(schema, path)
    yield path, schema, required
    prefix = f"{path}." if path else ""
    for name, sub in schema.get("properties", {}).items():
        yield from fields(sub, prefix + name, name in schema.get("required", []))
    items = schema.get("items")
    if isinstance(items, dict):
        yield from members(items, path + "[]")
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict):
        yield from members(extra, path + ".*")


def members(schema: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any], bool]]:
    """The fields of a list's items or a map's values; scalar ones are rendered at the parent."""
    check_keywords(schema, path)
    if schema.get("type") in ("object", "array") and not schema.get("x-kubernetes-int-or-string"):
        if set(schema) - {"type", "properties", "required"}:
            # Rules, a description or a default of the item itself, or a list of lists:
            # the item gets its own heading.
            yield from fields(schema, path, False)
            return
        for name, sub in schema["properties"].items():
            yield from fields(sub, f"{path}.{name}", name in schema.get("required", []))
        return
    if set(schema) - SCALAR_MEMBER:
        raise ValueError(f"{path}: item keywords not rendered: {sorted(set(schema) - SCALAR_MEMBER)}")


def constraints(schema: dict[str, Any]) -> list[str]:
    """The bullet lines of one field: default, enum, bounds, list semantics, rules."""
    lines = []
    if "default" in schema:
        lines.append(f"- Default: {value(schema['default'])}")
    if "enum" in schema:
        lines.append("- One of: " + ", ".join(code(str(v)) for v in schema["enum"]))
    if "pattern" in schema:
        lines.append(f"- Pattern: {code(schema['pattern'])}")
    for key, label in BOUNDS:
        if key in schema:
            lines.append(f"- {label}: {schema[key]}")
    for key, each in (("items", "Each item"), ("additionalProperties", "Each value")):
        member = schema.get(key)
        if not isinstance(member, dict) or member.get("type") in ("object", "array"):
            continue
        for bound, label in BOUNDS[4:6]:
            if bound in member:
                lines.append(f"- {each}: {label.lower()} {member[bound]}")
        if "pattern" in member:
            lines.append(f"- {each}: pattern {code(member['pattern'])}")
        if "enum" in member:
            lines.append(f"- {each}: one of " + ", ".join(code(str(v)) for v in member["enum"]))
    if "x-kubernetes-list-type" in schema:
        keys = schema.get("x-kubernetes-list-map-keys")
        keyed = f", keyed by {', '.join(code(k) for k in keys)}" if keys else ""
        lines.append(f"- List type: {code(schema['x-kubernetes-list-type'])}{keyed}")
    if "x-kubernetes-map-type" in schema:
        lines.append(f"- Map type: {code(schema['x-kubernetes-map-type'])}")
    if schema.get("nullable"):
        lines.append("- Nullable")
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        lines.append("- Unknown fields are kept (x-kubernetes-preserve-unknown-fields)")
    if schema.get("x-kubernetes-embedded-resource"):
        lines.append("- An embedded Kubernetes object (x-kubernetes-embedded-resource)")
    for rule in schema.get("x-kubernetes-validations", []):
        lines.append(f"- Rule: {code(' '.join(rule['rule'].split()))}")
        if "message" in rule:
            lines.append(f"  - Message: {prose(rule['message'])}")
        if "messageExpression" in rule:
            lines.append(f"  - Message expression: {code(rule['messageExpression'])}")
        if "fieldPath" in rule:
            lines.append(f"  - Reported at: {code(rule['fieldPath'])}")
        if "reason" in rule:
            lines.append(f"  - Reason: {code(rule['reason'])}")
        if "optionalOldSelf" in rule:
            lines.append(f"  - optionalOldSelf: {value(rule['optionalOldSelf'])}")
    return lines


def render_schema(schema: dict[str, Any], heading: str = "###") -> str:
    """Every field of an openAPIV3Schema, one heading each, in the schema's order."""
    blocks = []
    for path, sub, required in fields(schema, "", False):
        title = code(path) if path else "The object (root)"
        facts = code(type_of(sub)) + (", required" if required else "")
        block = [f"{heading} {title}", "", facts, ""]
        if "description" in sub:
            block += [prose(sub["description"]), ""]
        lines = constraints(sub)
        if lines:
            block += lines + [""]
        blocks.append("\n".join(block))
    return "\n".join(blocks)


def render(crd: dict[str, Any], source: str, source_link: str, guide_link: str | None) -> str:
    """The whole reference page of one CustomResourceDefinition.

    `source` names the CRD file in the page; `source_link` and `guide_link` (the
    hand-written guide, or None) are links relative to where the page is written.
    """
    spec = crd["spec"]
    names = spec["names"]
    out = [
        f"# {names['kind']} field reference",
        "",
        f"<!-- Generated by hack/crd_reference.py from {source}; do not edit, run `make docs`. -->",
        "",
        f"Generated from [`{source}`]({source_link}) (`make docs`); "
        "`tests/unit/test_crd_reference.py` fails when it is not current."
        + (f" What the fields are for: [the configuration guide]({guide_link})." if guide_link else ""),
        "",
        "| | |",
        "|---|---|",
        f"| API group | {code(spec['group'])} |",
        f"| kind | {code(names['kind'])} ({code(names.get('listKind', names['kind'] + 'List'))}) |",
        f"| scope | {spec['scope']} |",
        f"| plural, singular | {code(names['plural'])}, {code(names.get('singular', ''))} |",
    ]
    if names.get("shortNames"):
        out.append(f"| short names | {', '.join(code(n) for n in names['shortNames'])} |")
    if names.get("categories"):
        out.append(f"| categories | {', '.join(code(n) for n in names['categories'])} |")
    out.append("")
    for version in spec["versions"]:
        out += [f"## {code(version['name'])}", ""]
        out += [f"Served: {'yes' if version.get('served') else 'no'}; storage version: "
                f"{'yes' if version.get('storage') else 'no'}; subresources: "
                + (", ".join(code(s) for s in version.get("subresources", {})) or "none") + ".", ""]
        columns = version.get("additionalPrinterColumns", [])
        if columns:
            out += ["Columns of `kubectl get`:", "", "| column | type | from |", "|---|---|---|"]
            out += [f"| {c['name']} | {c['type']} | {code(c['jsonPath'])} |" for c in columns]
            out.append("")
        out.append(render_schema(version["schema"]["openAPIV3Schema"]))
    return "\n".join(out).rstrip("\n") + "\n"


def generate(crd_path: Path = DEFAULT_CRD, out_path: Path = DEFAULT_OUT) -> str:
    """The page for `crd_path` as it reads when written to `out_path`."""
    crd = yaml.safe_load(crd_path.read_text(encoding="utf-8"))
    crd_path, out_dir = crd_path.resolve(), out_path.resolve().parent
    try:
        source = crd_path.relative_to(ROOT).as_posix()
    except ValueError:
        source = crd_path.name
    guide = ROOT / "docs" / "configuration.md"
    return render(
        crd,
        source,
        Path(os.path.relpath(crd_path, out_dir)).as_posix(),
        Path(os.path.relpath(guide, out_dir)).as_posix(),
    )


def main(argv: list[str]) -> int:
    crd_path = Path(argv[0]) if argv else DEFAULT_CRD
    out_path = Path(argv[1]) if len(argv) > 1 else DEFAULT_OUT
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(generate(crd_path, out_path), encoding="utf-8")
    print(f"Wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
