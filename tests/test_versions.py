"""pyproject.toml's lower bounds are the tested minimum set (constraints-min.txt, checked by
scripts/check_min_versions.sh), and the installed versions satisfy pyproject.toml."""
from __future__ import annotations

import importlib.metadata

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from conftest import ROOT

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11


def declared() -> list[tuple[Requirement, bool]]:
    """(requirement, optional) for every dependency in pyproject.toml, extras included."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    reqs = [(Requirement(r), False) for r in project["dependencies"]]
    reqs += [(Requirement(r), True) for extra in project["optional-dependencies"].values() for r in extra]
    return reqs


def pins() -> dict[str, Version]:
    out = {}
    for line in (ROOT / "constraints-min.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            out[canonicalize_name(name)] = Version(version)
    return out


def lower_bound(req: Requirement) -> Version | None:
    found = [Version(s.version) for s in req.specifier if s.operator == ">="]
    return max(found) if found else None


def test_lower_bounds_are_the_tested_minimum_versions():
    tested = pins()
    names = set()
    for req, _ in declared():
        name = canonicalize_name(req.name)
        names.add(name)
        assert name in tested, f"{req.name} is declared but constraints-min.txt has no tested minimum for it"
        assert lower_bound(req) == tested[name], f"pyproject {req} vs constraints-min.txt {req.name}=={tested[name]}"
    assert set(tested) <= names, f"constraints-min.txt pins undeclared packages: {set(tested) - names}"


def test_installed_versions_satisfy_pyproject():
    for req, optional in declared():
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            installed = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            assert optional, f"{req.name} is a required dependency but is not installed"
            continue
        assert req.specifier.contains(installed, prereleases=True), f"installed {req.name} {installed} vs {req}"
