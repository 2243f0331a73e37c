"""Print what a rank received: its argv, the environment variables named in
TORCHRIG_SHOW_ENV and the sha256 of those in TORCHRIG_HASH_ENV (comma lists), as one JSON line
per rank. A debugging aid for launch:
`invoke launch --script env_check.py --args "..." --env KEY=VAL`."""

import hashlib
import json
import os
import socket
import sys

import progress

names = [n for n in os.environ.get("TORCHRIG_SHOW_ENV", "").split(",") if n]
# secrets are proven present by their digest, never printed
hashed = [n for n in os.environ.get("TORCHRIG_HASH_ENV", "").split(",") if n]
print(progress.format_line("start", {"rank": os.environ.get("RANK", "0"),
                                     "local_rank": os.environ.get("LOCAL_RANK", "0"),
                                     "host": socket.gethostname()}), flush=True)
print("ENV_CHECK " + json.dumps({"rank": int(os.environ.get("RANK", "0")), "argv": sys.argv[1:],
                                 "env": {n: os.environ.get(n) for n in names},
                                 "sha256": {n: hashlib.sha256(os.environ.get(n, "").encode()).hexdigest()
                                            for n in hashed}}), flush=True)
