# Refuses (exit 3, one line on stderr) a pip --dry-run --report that would install a package
# of the provisioned stack (torch, triton, NVIDIA's CUDA/NCCL wheels) into a job environment,
# unless the second argument is 1 (launch --allow-torch-change).
import json
import re
import sys

report, allow = sys.argv[1], sys.argv[2] == "1"
with open(report) as f:
    items = json.load(f).get("install", [])
hit = []
for it in items:
    meta = it.get("metadata", {})
    name = re.sub(r"[-_.]+", "-", meta.get("name", "")).lower()
    if name in ("torch", "triton", "pytorch-triton") or name.startswith("nvidia-"):
        hit.append(f"{name} {meta.get('version', '?')}")
if hit and not allow:
    print("error: the requirements would install " + ", ".join(hit) + " into the job "
          "environment, replacing the provisioned one(s); keep torch as provisioned (var "
          "torch_version) or pass --allow-torch-change", file=sys.stderr)
    sys.exit(3)
