"""Every package's docstring names each of its modules (a newcomer reads the package from its
__init__), and a package that says it imports no torch imports none at module level."""
import ast
from pathlib import Path

import pytest

from tests.config.test_layering import module_level_imports
from tests.helpers.runner import REPO

PACKAGES = sorted(p.parent for p in (REPO / "megatron_taper").rglob("__init__.py"))


def docstring(package: Path) -> str:
    return ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_the_package_docstring_names_every_module(package):
    doc = docstring(package)
    modules = sorted(p.name for p in package.glob("*.py") if p.name != "__init__.py")
    subpackages = sorted(p.name for p in package.iterdir() if (p / "__init__.py").exists())
    if package.name == "megatron_taper":  # the top level: README's "Layout" lists it
        return
    missing = [m for m in modules if m not in doc] + [f"{s}/" for s in subpackages if f"{s}/" not in doc]
    assert not missing, f"{package.relative_to(REPO)}/__init__.py does not name {missing}"


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_a_package_that_says_torch_free_imports_no_torch(package):
    doc = docstring(package).lower()
    claim = doc.split("\n\n")[0]
    if "torch-free" not in claim and "no torch at module level" not in claim:
        return
    dotted = ".".join(package.relative_to(REPO).parts)
    for module in sorted(package.glob("*.py")):
        name = dotted if module.name == "__init__.py" else f"{dotted}.{module.stem}"
        torch = {m for m in module_level_imports(name) if m == "torch" or m.startswith("torch.")}
        assert not torch, f"{name} imports {sorted(torch)} though {dotted} says it is torch-free"
