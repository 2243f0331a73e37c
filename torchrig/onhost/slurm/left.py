# torchrig stop of a Slurm job: how many processes on this node still carry SLURM_JOB_ID=<argv[1]>
# in their environment (python3 -I -, as root, this text on stdin).
import os, sys
want = b"SLURM_JOB_ID=" + sys.argv[1].encode() + b"\0"
n = 0
for p in os.listdir("/proc"):
    if p.isdigit():
        try:
            env = open(f"/proc/{p}/environ", "rb").read() + b"\0"
        except OSError:
            continue
        if b"\0" + want in b"\0" + env:
            n += 1
print(n)
