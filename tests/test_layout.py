"""The README's Layout section is the map of the tree: every package folder is on it, under its import name,
and every folder on it exists."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IMPORT_ROOTS = {"loader_server": "packfeed.server", "client": "packfeed.client", "trainer": "packfeed.trainer",
                "media": "packfeed.media", "protos/packfeed/v1": "packfeed.v1"}


def layout_rows() -> dict[str, str]:
    """folder -> import name ('' where none) from the README's Layout table."""
    section = REPO.joinpath("README.md").read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)/` \| (?:`([^`]+)`)? \|", section, flags=re.M)
    assert rows, "no Layout table in README.md"
    return dict(rows)


def import_name(folder: str) -> str:
    for root, name in IMPORT_ROOTS.items():
        if folder == root or folder.startswith(root + "/"):
            return name + folder[len(root):].replace("/", ".")
    return ""


def test_every_package_is_on_the_map_under_its_import_name():
    rows = layout_rows()
    packages = {str(init.parent.relative_to(REPO)) for root in IMPORT_ROOTS if (REPO / root).is_dir()
                for init in (REPO / root).rglob("__init__.py")} | {"protos/packfeed/v1"}
    assert packages - set(rows) == set(), "packages missing from README's Layout"
    for folder, name in rows.items():
        assert (REPO / folder).is_dir(), f"README's Layout lists {folder}/, which does not exist"
        assert name == import_name(folder), folder


def test_every_package_is_installed():
    """pyproject's package list names every package: a wheel (the Docker image) would leave out one it missed."""
    import tomllib

    listed = set(tomllib.loads(REPO.joinpath("pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {import_name(str(init.parent.relative_to(REPO))) for root in IMPORT_ROOTS if (REPO / root).is_dir()
                for init in (REPO / root).rglob("__init__.py")} | {"packfeed.v1"}
    assert packages - listed == set()


def test_integrations_stay_optional_extras():
    """`pip install packfeed` installs no training framework and no browser: they come with the extras."""
    import tomllib

    project = tomllib.loads(REPO.joinpath("pyproject.toml").read_text())["project"]
    required = {re.split(r"[<>=\[ ;]", spec, maxsplit=1)[0].lower() for spec in project["dependencies"]}
    assert required & {"torch", "transformers", "accelerate", "trl", "lightning", "playwright", "selenium"} == set()
    extras = project["optional-dependencies"]
    assert any(spec.startswith("accelerate") for spec in extras["hf-trainer"])
    assert any(spec.startswith("trl") for spec in extras["trl"])
    assert any(spec.startswith("lightning") for spec in extras["lightning"])
