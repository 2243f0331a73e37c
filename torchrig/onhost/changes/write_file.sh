{# The one atomic write of a managed file (provision and launch alike): a temp file beside the
   target (mktemp: 0600, so a secret is never readable while it is written), its mode and
   owner set, then renamed: readers never see a half-written file. The folders it creates are
   0755 whatever umask sudo passed on (a sampler under a 0700 /usr/local/lib/torchrig could not
   run as the service user). The contents travel base64'd through printf, a shell builtin:
   never in a command line. #}
(umask 022 && mkdir -p -- {{ folder }})
tmp=$(mktemp {{ path ~ ".torchrig.XXXXXX" }})
printf %s {{ data }} | base64 -d > "$tmp"
chmod {{ mode }} "$tmp"
chown {{ owner }} "$tmp"
mv -f "$tmp" {{ path }}
