"""Schemas that no finite JSON value matches, through recursion: two `$ref`s that point at each other, an object
that requires a property of its own type. Pure logic.

llguidance compiles these; the worker then either fails at its first token mask with an internal message or lets
the model nest without end until max_tokens. Here a schema is satisfiable when some finite value can match it:
the least fixed point of "has a finite instance" over its subschemas, where an object needs its required
properties, an array its first minItems items, allOf all branches, anyOf/oneOf one, and `$ref` its target.
Only recursion is judged; anything else (contradictory bounds, types) is the compiler's to report.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

from omlx_jobs.jobs.schema_limits import subschemas

MAX_PASSES = 64
"""Each pass settles every chain of references in order; cycles settle within a few. Beyond: judged satisfiable."""
_OTHER_TYPES = {"string", "number", "integer", "boolean", "null"}


def unsatisfiable(schema: dict[str, Any]) -> tuple[str, str] | None:
    """(path of the `$ref` or schema where a cycle no value gets out of closes, message), or None if satisfiable."""
    nodes = list(subschemas(schema))
    check = _Finite(schema, {id(node): path for path, node in nodes})
    if not check.settle([node for _, node in reversed(nodes)]) or check.ok(schema):  # children first: fewer passes
        return None
    path, via = check.cycle()
    return (
        path,
        f"can never be satisfied: through {via} it requires a value of its own kind inside itself, with no way "
        "to end (no finite JSON value matches). Make the recursive property optional, or give it a branch that "
        "ends (anyOf with null)",
    )


def resolve_ref(root: dict[str, Any], ref: Any) -> Any:
    """The schema a local `$ref` ("#", "#/$defs/a", JSON-pointer escapes) names in `root`; None if not local."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node: Any = root
    for raw in ref[1:].split("/")[1:]:
        part = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


class _Finite:
    """Which subschemas of `root` have a finite instance: grown pass by pass to the least fixed point."""

    def __init__(self, root: dict[str, Any], paths: dict[int, str]) -> None:
        self.root, self.paths = root, paths
        self.finite: set[int] = set()

    def settle(self, order: list[dict[str, Any]]) -> bool:
        """Grow `finite` until nothing changes; False if it did not settle within MAX_PASSES."""
        for _ in range(MAX_PASSES):
            before = len(self.finite)
            self.finite.update(id(n) for n in order if id(n) not in self.finite and self._has_finite_instance(n))
            if len(self.finite) == before:
                return True
        return False

    def ok(self, sub: Any) -> bool:
        """Whether `sub` has a finite instance as far as known; a schema we did not walk is the compiler's to judge."""
        if isinstance(sub, bool):
            return sub
        return not isinstance(sub, dict) or id(sub) not in self.paths or id(sub) in self.finite

    def _has_finite_instance(self, node: dict[str, Any]) -> bool:
        if not all(self.ok(n) for n in self._needs(node)):
            return False
        for key in ("anyOf", "oneOf"):
            branches = node.get(key)
            if isinstance(branches, list) and branches and not any(self.ok(b) for b in branches):
                return False
        if "const" in node or "enum" in node:
            return True
        types = node.get("type")
        kinds = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else None
        if kinds is None or kinds & _OTHER_TYPES:
            return True  # a string or a number matches: nothing recursive is needed
        object_ok = "object" in kinds and all(self.ok(s) for s in _required_schemas(node))
        array_ok = "array" in kinds and all(self.ok(s) for s in _required_items(node))
        return object_ok or array_ok

    def _needs(self, node: dict[str, Any]) -> list[Any]:
        """What every instance of `node` must also match, whatever its type: its $ref target and allOf."""
        needs: list[Any] = []
        if "$ref" in node:
            target = resolve_ref(self.root, node["$ref"])
            if target is not None:
                needs.append(target)
        if isinstance(node.get("allOf"), list):
            needs.extend(node["allOf"])
        return needs

    def _unmet(self, node: dict[str, Any]) -> list[Any]:
        unmet = [n for n in self._needs(node) if not self.ok(n)]
        unmet += [n for n in _required_schemas(node) + _required_items(node) if not self.ok(n)]
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list):
                unmet += [b for b in node[key] if not self.ok(b)][:1]
        return unmet

    def cycle(self) -> tuple[str, str]:
        """(path, where) of the place a chain of unmet needs, followed from the root, comes round again."""
        node: Any = self.root
        seen: set[int] = set()
        while isinstance(node, dict) and id(node) not in seen:
            seen.add(id(node))
            unmet = self._unmet(node)
            if not unmet:
                break
            if isinstance(unmet[0], dict) and id(unmet[0]) in seen:
                where = self.paths.get(id(node), "")
                return (f"{where}.$ref" if "$ref" in node else where), where or "the schema's root"
            node = unmet[0]
        where = self.paths.get(id(node), "") if isinstance(node, dict) else ""
        return where, where or "the schema's root"


def _required_schemas(node: dict[str, Any]) -> list[Any]:
    """The schemas of an object's required properties (True where a pattern may decide: the compiler's call)."""
    props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    required = node.get("required") if isinstance(node.get("required"), list) else []
    extra = True if node.get("patternProperties") else node.get("additionalProperties", True)
    return [props.get(k, extra) for k in required if isinstance(k, str) and (k in props or extra)]


def _required_items(node: dict[str, Any]) -> list[Any]:
    """The schemas of an array's first minItems items."""
    wanted = node.get("minItems", 0)
    if not isinstance(wanted, int) or wanted <= 0:
        return []
    prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
    items = node.get("items", True)
    return prefix[:wanted] + ([items] if wanted > len(prefix) else [])
