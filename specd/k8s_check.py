"""`make k8s-check`: the manifests in k8s/ against the schemas Kubernetes itself would apply.

    python -m specd.k8s_check [FILE.yaml ...] [--crd PATH] [--kube-version X.Y]

* A `RayService` is checked against the KubeRay operator's CRD, its OpenAPI v3 schema
  (`spec.versions[0].schema.openAPIV3Schema`), read from `--crd`, else `$KUBERAY_CRD`, else
  the copy in this repository, `k8s/schemas/ray.io_rayservices.yaml` (its source and version:
  `k8s/schemas/README.md`). Two passes:
    1. `jsonschema` (Draft 4, the dialect OpenAPI 3.0 extends) for types, required fields,
       enums, patterns and bounds; `nullable` is translated, `format: int32/int64` range-checked.
    2. A walk of the structural schema for what JSON Schema does not say but the API server
       does: a field the schema does not know is an error (the API server would silently prune
       it: CRD schemas rarely set `additionalProperties: false`), wherever an object lists
       `properties` and has neither `additionalProperties` nor
       `x-kubernetes-preserve-unknown-fields`; `x-kubernetes-list-type: set/map` lists must not
       repeat an item / a key; CEL rules (`x-kubernetes-validations`) of the form
       `self in [...]` hold (transition rules, on `oldSelf`, apply to updates only; any other
       rule on a field the manifest sets is printed as not evaluated). The root `metadata` is
       checked as an ObjectMeta.
* Every other Kubernetes object (the Service, ...) is checked with `kubernetes-validate` in
  strict mode (unknown fields are errors), against its bundled schemas: no network, no cluster.
* A YAML document without apiVersion/kind (k8s/cluster-demo.yaml, a specd ClusterConfig)
  is not a Kubernetes object: skipped here (tests/cluster/test_k8s.py validates it).

Prints what it checked and every error with its path (`spec.rayClusterConfig.workerGroupSpecs[0].replicas`);
exits 1 on any error, 2 when a schema cannot be read.
Does not know: Ray's Serve config inside `serveConfigV2` (a string to the CRD; tests/cluster/test_k8s.py
checks it with Ray's own schema).
"""
from __future__ import annotations

import argparse
import ast
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CRD = ROOT / "k8s" / "schemas" / "ray.io_rayservices.yaml"
INT_RANGES = {"int32": (-2**31, 2**31 - 1), "int64": (-2**63, 2**63 - 1)}
EMBEDDED_KEYS = ("apiVersion", "kind", "metadata")  # implied by x-kubernetes-embedded-resource
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@dataclass(frozen=True)
class Problem:
    path: str  # "spec.rayClusterConfig.headGroupSpec.bogusField"; "" = the document itself
    message: str

    def __str__(self) -> str:
        return f"{self.path or '<document>'}: {self.message}"


def fmt_path(parts) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


# ---- the KubeRay CRD --------------------------------------------------------------------------------
@dataclass
class Crd:
    path: Path
    group: str
    kind: str
    version: str  # spec.versions[0].name
    schema: dict  # its openAPIV3Schema

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"


def crd_path(explicit: str | os.PathLike | None = None) -> Path:
    return Path(explicit or os.environ.get("KUBERAY_CRD") or DEFAULT_CRD)


def load_crd(path: str | os.PathLike | None = None) -> Crd:
    p = crd_path(path)
    docs = [d for d in yaml.load_all(p.read_text(), Loader=_LOADER) if d]  # 1 MB: the C loader
    crds = [d for d in docs if d.get("kind") == "CustomResourceDefinition"]
    if len(crds) != 1:
        raise ValueError(f"{p}: expected one CustomResourceDefinition, found {len(crds)}")
    spec = crds[0]["spec"]
    v0 = spec["versions"][0]
    return Crd(p, spec["group"], spec["names"]["kind"], v0["name"], v0["schema"]["openAPIV3Schema"])


def _to_json_schema(node: Any) -> Any:
    """OpenAPI v3 -> JSON Schema draft 4: `nullable: true` admits null (the rest is shared)."""
    if isinstance(node, list):
        return [_to_json_schema(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _to_json_schema(v) for k, v in node.items() if k != "nullable"}
    if node.get("nullable"):
        if "type" in out:
            out["type"] = [out["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    return out


_FORMATS = jsonschema.FormatChecker(())
for _name, (_lo, _hi) in INT_RANGES.items():
    _FORMATS.checks(_name)(lambda v, lo=_lo, hi=_hi: not isinstance(v, int) or isinstance(v, bool) or lo <= v <= hi)


def _schema_errors(doc: dict, schema: dict) -> Iterator[Problem]:
    v = jsonschema.Draft4Validator(_to_json_schema(schema), format_checker=_FORMATS)
    for e in v.iter_errors(doc):
        yield from _expand(e)


def _expand(e: jsonschema.ValidationError) -> Iterator[Problem]:
    """One Problem per offending field (jsonschema names the parent of an unknown field)."""
    path = list(e.absolute_path)
    if e.validator == "additionalProperties" and e.validator_value is False and isinstance(e.instance, dict):
        known = set(e.schema.get("properties", {}))
        for k in sorted(set(e.instance) - known):
            yield Problem(fmt_path(path + [k]), "unknown field (not in the schema)")
        return
    if e.validator == "required" and isinstance(e.validator_value, list):
        missing = [k for k in e.validator_value if isinstance(e.instance, dict) and k not in e.instance]
        for k in missing:
            yield Problem(fmt_path(path + [k]), "required field missing")
        if missing:
            return
    if e.context:  # anyOf/oneOf: say what each branch wanted
        yield Problem(fmt_path(path), f"{e.message}: " + "; ".join(sorted({c.message for c in e.context})))
        return
    yield Problem(fmt_path(path), e.message)


def _structural_errors(value: Any, schema: dict, path: list, notes: list[Problem]) -> Iterator[Problem]:
    """What the API server enforces beyond JSON Schema: unknown fields, list-type uniqueness."""
    if not isinstance(schema, dict):
        return
    for rule in schema.get("x-kubernetes-validations", []):
        yield from _cel(value, rule, path, notes)
    if isinstance(value, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        preserve = schema.get("x-kubernetes-preserve-unknown-fields", False)
        embedded = schema.get("x-kubernetes-embedded-resource", False)
        for k, v in value.items():
            if props is not None and k in props:
                yield from _structural_errors(v, props[k], path + [k], notes)
            elif isinstance(extra, dict):
                yield from _structural_errors(v, extra, path + [k], notes)
            elif props is not None and extra is None and not preserve and not (embedded and k in EMBEDDED_KEYS):
                yield Problem(fmt_path(path + [k]), "unknown field (not in the CRD schema; the API server "
                                                    "would drop it)")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        items = schema["items"]
        kind = schema.get("x-kubernetes-list-type")
        seen: dict = {}
        for i, item in enumerate(value):
            if kind == "set":
                key = yaml.safe_dump(item, sort_keys=True)
            elif kind == "map" and isinstance(item, dict):
                defaults = {k: items.get("properties", {}).get(k, {}).get("default")
                            for k in schema.get("x-kubernetes-list-map-keys", [])}
                key = tuple((k, item.get(k, d)) for k, d in defaults.items())
            else:
                key = None
            if key is not None:
                if key in seen:
                    what = ", ".join(f"{k}={v}" for k, v in key) if kind == "map" else "the same value"
                    yield Problem(fmt_path(path + [i]), f"duplicate entry of a list-type {kind} ({what} "
                                                        f"as at [{seen[key]}])")
                seen.setdefault(key, i)
            yield from _structural_errors(item, items, path + [i], notes)


def _cel(value: Any, rule: dict, path: list, notes: list[Problem]) -> Iterator[Problem]:
    """The CEL rules this CRD uses: `self in [literals]` is evaluated; a transition rule (it reads
    `oldSelf`) applies to updates only; anything else is reported as not evaluated."""
    text = rule.get("rule", "")
    if "oldSelf" in text:
        return
    m = re.fullmatch(r"\s*self\s+in\s+(\[.*\])\s*", text)
    if m:
        try:
            allowed = ast.literal_eval(m.group(1))
        except (ValueError, SyntaxError):
            allowed = None
        if isinstance(allowed, list):
            if value not in allowed:
                yield Problem(fmt_path(path), rule.get("message") or f"must satisfy {text}")
            return
    notes.append(Problem(fmt_path(path), f"CEL rule not evaluated here: {text}"))


def check_custom(doc: dict, crd: Crd, notes: list[Problem] | None = None) -> list[Problem]:
    """Errors of one custom object against the CRD (empty list: valid)."""
    notes = [] if notes is None else notes
    problems: list[Problem] = []
    if doc.get("apiVersion") != crd.api_version:
        problems.append(Problem("apiVersion", f"is {doc.get('apiVersion')!r}; the schema checked is "
                                              f"{crd.api_version!r} (spec.versions[0] of {crd.path.name})"))
    problems += _schema_errors(doc, crd.schema)
    problems += _structural_errors(doc, crd.schema, [], notes)
    if isinstance(doc.get("metadata"), dict):  # the root metadata is an ObjectMeta (not in the CRD)
        problems += check_core({"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]})
    return sorted(set(problems), key=lambda p: (p.path, p.message))


# ---- core objects: kubernetes-validate ----------------------------------------------------------------
def kube_version(explicit: str | None = None) -> str:
    import kubernetes_validate

    return explicit or os.environ.get("KUBE_VERSION") or kubernetes_validate.latest_version()


def check_core(doc: dict, version: str | None = None) -> list[Problem]:
    """Errors of one built-in Kubernetes object, `kubernetes-validate` strict (unknown fields fail).
    Every error, not only the first one that kubernetes_validate.validate raises."""
    import kubernetes_validate
    from kubernetes_validate import utils as kvu
    from referencing import Registry, Resource

    version = kube_version(version).lstrip("v")
    mm = kvu.major_minor(version)
    full = [v for v in kvu.all_versions() if kvu.major_minor(v) == mm]
    if not full:
        raise kubernetes_validate.VersionNotSupportedError(version)
    schema_dir = f"kubernetes-json-schema/v{full[-1]}-local-strict"
    api = doc.get("apiVersion", "")
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", str(api))  # rbac.authorization.k8s.io/v1 -> rbac-v1
    name = f"{schema_dir}/{str(doc.get('kind', '')).lower()}-{group_version}.json"
    try:
        schema = kvu.schema_contents(name, version)
    except FileNotFoundError:
        return [Problem("kind", f"no Kubernetes {mm} schema for kind {doc.get('kind')!r} "
                                f"apiVersion {api!r} (a custom resource without a CRD here?)")]
    defs = kvu.schema_contents(f"{schema_dir}/_definitions.json", version)
    registry = Resource.from_contents(defs) @ (Resource.from_contents(schema) @ Registry())
    v = jsonschema.Draft202012Validator(schema, registry=registry)
    return sorted({p for e in v.iter_errors(doc) for p in _expand(e)}, key=lambda p: (p.path, p.message))


# ---- the command ----------------------------------------------------------------------------------------
def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def describe(doc: dict) -> str:
    return f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name', '?')}"


def check_files(paths: list[Path], crd: Crd | None, kube: str, out=None) -> int:
    """Check every document of `paths`; print a line per object and per error. Returns the error count."""
    out = out or sys.stdout
    errors = checked = 0
    for path in paths:
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        for i, doc in enumerate(documents(path)):
            where = f"{shown}#{i}"
            if not isinstance(doc, dict) or "apiVersion" not in doc or "kind" not in doc:
                print(f"  skip  {where}: not a Kubernetes object (no apiVersion/kind)", file=out)
                continue
            notes: list[Problem] = []
            if crd is not None and doc["kind"] == crd.kind:
                found, how = check_custom(doc, crd, notes), f"CRD {crd.api_version} {crd.kind} ({crd.path})"
            else:
                found, how = check_core(doc, kube), f"kubernetes-validate {kube} strict"
            checked += 1
            print(f"  {'ok   ' if not found else 'FAIL '} {where} {describe(doc)}: {how}", file=out)
            for p in notes:
                print(f"        note  {p}", file=out)
            for p in found:
                print(f"        ERROR {where} {describe(doc)}: {p}", file=out)
            errors += len(found)
    print(f"k8s-check: {checked} objects checked, {errors} errors", file=out)
    return errors


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specd.k8s_check", description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="*", type=Path, help="manifests (default: k8s/*.yaml)")
    ap.add_argument("--crd", help=f"the RayService CRD (default: $KUBERAY_CRD, else {DEFAULT_CRD})")
    ap.add_argument("--kube-version", help="Kubernetes version of the core schemas (default: $KUBE_VERSION, "
                                           "else the newest kubernetes-validate ships)")
    args = ap.parse_args(argv)
    files = [f.resolve() for f in args.files] or sorted((ROOT / "k8s").glob("*.yaml"))
    if not files:
        print("k8s-check: no manifests", file=sys.stderr)
        return 2
    try:
        crd = load_crd(args.crd)
    except (OSError, ValueError, KeyError, IndexError, yaml.YAMLError) as e:
        print(f"k8s-check: cannot read the RayService CRD at {crd_path(args.crd)} "
              f"(set KUBERAY_CRD=...): {e}", file=sys.stderr)
        return 2
    try:
        kube = kube_version(args.kube_version)
        print(f"k8s-check: {len(files)} files; RayService against {crd.path} "
              f"(spec.versions[0] = {crd.version}); core objects against kubernetes-validate {kube}")
        return 1 if check_files(files, crd, kube) else 0
    except Exception as e:  # a schema kubernetes-validate cannot load: not the manifests' fault
        if type(e).__module__.startswith("kubernetes_validate"):
            print(f"k8s-check: {getattr(e, 'message', e)}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
