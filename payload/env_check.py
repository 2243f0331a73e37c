"""Print what a rank received: its argv and the environment variables named in
TORCHRIG_SHOW_ENV (comma list), as one JSON line per rank. A debugging aid for launch:
`invoke launch --script env_check.py --args "..." --env KEY=VAL`."""

import json
import os
import socket
import sys

names = [n for n in os.environ.get("TORCHRIG_SHOW_ENV", "").split(",") if n]
print("start rank={} local_rank={} host={}".format(
    os.environ.get("RANK", "0"), os.environ.get("LOCAL_RANK", "0"), socket.gethostname()), flush=True)
print("ENV_CHECK " + json.dumps({"rank": int(os.environ.get("RANK", "0")), "argv": sys.argv[1:],
                                 "env": {n: os.environ.get(n) for n in names}}), flush=True)
