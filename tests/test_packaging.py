"""The wheel ships every import package of the repository (tests run from the checkout, where a
package missing from pyproject.toml would still import)."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP_LEVEL = ("latentspeed", "common_kernels", "vllm_plugin", "sglang_plugin", "quant_recipes")


def test_every_package_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for top in TOP_LEVEL
        for init in (ROOT / top).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert found - listed == set(), f"packages missing from pyproject.toml: {sorted(found - listed)}"
