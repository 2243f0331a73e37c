"""Where the files torchrig ships live, in one place: templates/, payload/ and
inventory/example.yml stay in the checkout's top-level folders (the layout readers know);
torchrig/shipped/ links to them, so the same paths work in a checkout, an editable install
and a wheel (`pip install .` copies the linked files into the package)."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SHIPPED = Path(__file__).resolve().parent / "shipped"
TEMPLATES = (SHIPPED / "templates").resolve()   # Jinja2 templates, mirroring target paths
PAYLOAD = (SHIPPED / "payload").resolve()       # what launch pushes to the nodes
EXAMPLE_INVENTORY = (SHIPPED / "example.yml").resolve()  # inventory/example.yml, for `torchrig init`


def payload_module(name: str) -> ModuleType:
    """payload/<name>.py (stdlib-only, pushed to the nodes) loaded as torchrig._payload_<name>:
    the operator's side uses the very file the nodes run, so a definition has no copy."""
    spec = importlib.util.spec_from_file_location(f"torchrig._payload_{name}", PAYLOAD / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod
