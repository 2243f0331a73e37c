"""Runs ON THE TARGET HOST (python3 -I -, one round trip, as the login user): GPU, topology,
driver and stack facts for `invoke verify`, as one JSON document. Standard library only;
imports torch only in the venv's own interpreter and only when asked (`torch_runtime`).

argv[1]: JSON {"query": "index,name,...", "venv": PATH, "torch_runtime": bool,
               "peer": {"address": A, "port": P} | null}
"""
import glob
import json
import os
import re
import socket
import subprocess
import sys
import time

want = json.loads(sys.argv[1])
out = {"hostname": socket.gethostname()}


def run(argv, timeout=60):
    try:
        r = subprocess.run(argv, capture_output=True, text=True, errors="replace",
                           timeout=timeout)  # lspci/nvidia-smi bytes need not be UTF-8
        return {"rc": r.returncode, "out": r.stdout, "err": r.stderr}
    except FileNotFoundError:
        return {"rc": 127, "out": "", "err": f"{argv[0]}: command not found"}
    except subprocess.TimeoutExpired:
        return {"rc": 124, "out": "", "err": f"{argv[0]}: timed out after {timeout}s"}


out["smi_query"] = run(["nvidia-smi", "--query-gpu=" + want["query"], "--format=csv,noheader,nounits"])
out["topo"] = run(["nvidia-smi", "topo", "-m"])
out["fabricmanager"] = run(["systemctl", "is-active", "nvidia-fabricmanager.service"])["out"].strip()

pk = run(["dpkg-query", "-W", "-f=${Package}\t${Version}\t${db:Status-Abbrev}\n",
          "nvidia-open", "cuda-drivers", "libnccl2", "cuda-toolkit-*"])["out"]
out["packages"] = {p: v for p, v, s in (ln.split("\t") for ln in pk.splitlines() if ln.count("\t") == 2)
                   if s[1:2] == "i"}
cuda = None
try:
    with open("/usr/local/cuda/version.json") as f:
        cuda = json.load(f)["cuda"]["version"]
except (OSError, ValueError, KeyError):
    pass
out["cuda_toolkit"] = cuda

venv = want.get("venv") or ""
py = os.path.join(venv, "bin", "python")
out["venv_exists"] = os.path.exists(py)
dists = {}
for meta in glob.glob(os.path.join(venv, "lib", "python3*", "site-packages", "torch-*.dist-info", "METADATA")):
    with open(meta, errors="replace") as f:
        m = re.search(r"^Version: (.+)$", f.read(4096), re.M)
    if m:
        dists["torch"] = m.group(1).strip()
out["dists"] = dists
m = re.search(r"^version(?:_info)?\s*=\s*(\S+)",
              open(os.path.join(venv, "pyvenv.cfg"), errors="replace").read()
              if os.path.exists(os.path.join(venv, "pyvenv.cfg")) else "", re.M)
out["python"] = m.group(1) if m else None

if want.get("torch_runtime") and out["venv_exists"]:
    code = ("import json, torch\n"
            "d = {'torch': torch.__version__, 'cuda': torch.version.cuda,\n"
            "     'cuda_available': torch.cuda.is_available(), 'device_count': torch.cuda.device_count(),\n"
            "     'nccl': None}\n"
            "try:\n"
            "    v = torch.cuda.nccl.version() if torch.cuda.is_available() else None\n"
            "    d['nccl'] = '.'.join(map(str, v)) if isinstance(v, tuple) else v\n"
            "except Exception as e:\n"
            "    d['nccl_error'] = str(e)\n"
            "print(json.dumps(d))\n")
    r = run([py, "-I", "-c", code], timeout=120)  # -I: nothing imported from the cwd
    try:
        out["torch_runtime"] = json.loads(r["out"].strip().splitlines()[-1])
    except (ValueError, IndexError):
        out["torch_runtime"] = {"error": (r["err"] or r["out"]).strip()[-500:]}

peer = want.get("peer")
if peer:
    net = {"address": peer["address"], "port": peer["port"]}
    try:
        infos = socket.getaddrinfo(peer["address"], peer["port"], socket.AF_INET, socket.SOCK_STREAM)
        ip = infos[0][4][0]
        net["resolved"] = ip
    except OSError as e:
        net["resolve_error"] = str(e)
        ip = None
    if ip:
        r = run(["ip", "-j", "route", "get", ip])
        try:
            route = json.loads(r["out"])[0]
            net["interface"], net["source"] = route.get("dev"), route.get("prefsrc")
        except (ValueError, IndexError):
            net["route_error"] = (r["err"] or r["out"]).strip()
        if peer.get("probe", True):  # launch's fast gate wants the route only
            # c10d's store socket is dual-stack: peers reach it as ::ffff:a.b.c.d, and every
            # rank logs a warning when that address has no name (glibc's hosts file does not
            # map it; DNS does)
            try:
                socket.getnameinfo(("::ffff:" + ip, 0, 0, 0), socket.NI_NAMEREQD)
            except OSError as e:
                net["reverse_error"] = str(e)
            t0 = time.monotonic()
            try:
                with socket.create_connection((ip, peer["port"]), timeout=5):
                    net["reachable"] = True
                    net["connect_ms"] = round((time.monotonic() - t0) * 1000, 2)
            except OSError as e:
                net["reachable"] = False
                net["connect_error"] = str(e)
    out["network"] = net

print(json.dumps(out))
