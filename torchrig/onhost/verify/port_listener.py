# torchrig verify: a throwaway TCP listener on the rendezvous port (argv[1]) of the first node,
# run by systemd-run (RuntimeMaxSec=120); the other nodes prove they can reach it.
import socket,sys
s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('0.0.0.0', int(sys.argv[1]))); s.listen(64)
while True:
    c, _ = s.accept(); c.close()
