# The distributions a job environment resolves (its own and the torch venv's, through its
# .pth line), one `name==version` per line, sorted: what the version gate compares.
import importlib.metadata as md
import re

seen = {}
for d in md.distributions():   # sys.path order: the environment's own first
    name = re.sub(r"[-_.]+", "-", (d.metadata["Name"] or "")).lower()
    if name and name not in seen:
        seen[name] = d.version
print("\n".join(f"{n}=={v}" for n, v in sorted(seen.items())))
