"""verify's facts: GPU, topology, driver and stack, as probe commands and reads, and the
probe's raw reply back as the dict verify.evaluate reads (pure)."""

from __future__ import annotations

import json
import os
import re

from . import dpkg, health_facts, python_env, smi_query, topo

PACKAGES = ["nvidia-open", "cuda-drivers", "libnccl2", "cuda-toolkit-*"]
CUDA_VERSION_FILE = "/usr/local/cuda/version.json"
# cuda-minimal-build / cuda-nvcc-X-Y installs have no version.json (an H200 box with CUDA 13.0)
NVCC = "/usr/local/cuda/bin/nvcc"
# run by the venv's own interpreter, only when asked: the only place torch is imported
TORCH_RUNTIME = ("import json, torch\n"
                 "d = {'torch': torch.__version__, 'cuda': torch.version.cuda,\n"
                 "     'cuda_available': torch.cuda.is_available(), 'device_count': torch.cuda.device_count(),\n"
                 "     'nccl': None}\n"
                 "try:\n"
                 "    v = torch.cuda.nccl.version() if torch.cuda.is_available() else None\n"
                 "    d['nccl'] = '.'.join(map(str, v)) if isinstance(v, tuple) else v\n"
                 "except Exception as e:\n"
                 "    d['nccl_error'] = str(e)\n"
                 "print(json.dumps(d))\n")


def probe_request(venv: str, torch_runtime: bool, peer: dict | None, health: bool = False,
                  diag: int | None = None) -> dict:
    """health: GPU health's commands too (health_facts), with `dcgmi diag -r diag` if asked."""
    py = os.path.join(venv, "bin", "python")
    run = {**(health_facts.probe_run(diag) if health else {}),
           "smi_query": smi_query.command(), "topo": topo.COMMAND,
           "fabricmanager": ["systemctl", "is-active", "nvidia-fabricmanager.service"],
           "dpkg-query": dpkg.query_argv(PACKAGES), "nvcc": [NVCC, "--version"]}
    if torch_runtime:  # -I: nothing imported from the cwd; a missing venv answers 127
        run["torch_runtime"] = {"argv": [py, "-I", "-c", TORCH_RUNTIME], "timeout": 120}
    req = {"run": run, "host": True, "exists": [py],
           # follow: /usr/local/cuda is update-alternatives' symlink to /usr/local/cuda-X.Y on
           # real installs (root's own paths); without it version.json was never read
           "read": {"cuda": {"path": CUDA_VERSION_FILE, "limit": 65536, "follow": True},
                    "pyvenv.cfg": {"path": os.path.join(venv, "pyvenv.cfg"), "limit": 65536}},
           "glob": {"torch": {"pattern": os.path.join(venv, python_env.DIST_INFO.format(name="torch-*")),
                              "limit": python_env.METADATA_LIMIT}}}
    if peer:
        req["connect"] = peer
    return req


def cuda_toolkit(version_json: str, nvcc_out: str = "") -> str | None:
    """/usr/local/cuda/version.json's CUDA version, else nvcc's ("release 13.0, V13.0.88")."""
    try:
        return json.loads(version_json)["cuda"]["version"]
    except (ValueError, KeyError, TypeError):
        m = re.search(r"release [\d.]+, V(\d+\.\d+(?:\.\d+)?)", nvcc_out)
        return m.group(1) if m else None


def torch_runtime(r: dict) -> dict:
    """The TORCH_RUNTIME program's last line, or the error it printed."""
    try:
        return json.loads(r["out"].strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": (r["err"] or r["out"]).strip()[-500:]}


def network(peer: dict, got: dict) -> dict:
    net = {"address": peer["address"], "port": peer["port"]}
    net.update({k: v for k, v in got.items() if k != "route"})
    if "route" in got:
        r = got["route"]
        try:
            route = json.loads(r["out"])[0]
            net["interface"], net["source"] = route.get("dev"), route.get("prefsrc")
        except (ValueError, IndexError, KeyError, AttributeError):
            net["route_error"] = (r["err"] or r["out"]).strip()
    return net


def facts(venv: str, peer: dict | None, raw: dict) -> dict:
    run, read = raw["run"], raw["read"]
    out = {"hostname": raw["host"]["hostname"], "smi_query": run["smi_query"], "topo": run["topo"],
           "fabricmanager": run["fabricmanager"]["out"].strip(),
           "packages": dpkg.parse_query(run["dpkg-query"]["out"]),
           "cuda_toolkit": cuda_toolkit((read["cuda"] or {}).get("text", ""), run["nvcc"]["out"]),
           "venv_exists": raw["exists"][os.path.join(venv, "bin", "python")],
           "dists": {k: v for k, v in python_env.dists(raw["glob"]["torch"].values()).items() if k == "torch"},
           "python": python_env.pyvenv_version((read["pyvenv.cfg"] or {}).get("text", ""))}
    if "torch_runtime" in run and out["venv_exists"]:
        out["torch_runtime"] = torch_runtime(run["torch_runtime"])
    if peer:
        out["network"] = network(peer, raw.get("connect", {}))
    if "health_xml" in run:
        out["health"] = health_facts.facts(run)
        out["euid"] = raw["host"].get("euid")
    return out
