"""Policy spec strings: one short name per cache policy, for `--modes` and `--policies`.

The grammar and its parser are `CacheConfig.from_spec` (config.py), the one place a spec
becomes a `CacheConfig`; `parse_policy` is that function, `parse_policies` reads a comma list.
e.g. "int4", "bf16", "int8+sink4/window256", "k8v4", "sink4/window256:absolute".
"""

from __future__ import annotations

from ..config import CacheConfig
from ..policy_spec import SPEC_HELP

__all__ = ["SPEC_HELP", "parse_policy", "parse_policies"]

#: The `CacheConfig` a spec string names (`CacheConfig.from_spec`); a bad spec is a ValueError.
parse_policy = CacheConfig.from_spec


def parse_policies(specs: str) -> dict[str, CacheConfig]:
    """A comma list of specs -> {spec: CacheConfig}, in order; duplicates are an error."""
    out: dict[str, CacheConfig] = {}
    for spec in (s.strip() for s in specs.split(",")):
        if not spec:
            raise ValueError(f"empty policy in {specs!r}")
        if spec in out:
            raise ValueError(f"policy {spec!r} given twice")
        out[spec] = parse_policy(spec)
    return out
