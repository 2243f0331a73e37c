"""Where the files torchrig ships live, in one place: templates/ and payload/ stay top-level
folders of the checkout (the layout readers know); torchrig/shipped/ links to them, so the
same paths work in a checkout, an editable install and a wheel (`pip install .` copies the
linked files into the package)."""

from pathlib import Path

SHIPPED = Path(__file__).resolve().parent / "shipped"
TEMPLATES = (SHIPPED / "templates").resolve()   # Jinja2 templates, mirroring target paths
PAYLOAD = (SHIPPED / "payload").resolve()       # what launch pushes to the nodes
