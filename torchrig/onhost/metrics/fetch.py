# torchrig metrics: runs on the node as the login user (python3 -I -, this text on stdin, the
# URL as argv: it holds no credential); prints node_exporter's torchrig_* lines. Proxies are
# ignored: the exporter is on this host's own address.
import sys, urllib.request as u
url = sys.argv[1]
try:
    body = u.build_opener(u.ProxyHandler({})).open(url, timeout=20).read(64 << 20)
except Exception as e:
    sys.stderr.write("error: node_exporter does not answer on %s (%s): run `torchrig provision` "
                     "on this host, or check var node_exporter_address\n" % (url, e))
    sys.exit(3)
for line in body.decode(errors="replace").splitlines():
    if line.startswith(("torchrig_", "node_time_seconds ")):
        print(line)
