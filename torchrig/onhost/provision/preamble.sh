{# What every provision step's root script starts with. Every apt-get and dpkg call goes
   through apt_get/dpkg_run: non-interactive, config files kept, and first wait for the dpkg
   lock (naming its holder: apt_lock_wait.py) up to lock_timeout seconds. TORCHRIG_TMP: a
   private folder (mktemp -d: root's, 0700, a fresh random name) for downloads and
   credentials, removed however the script ends: no fixed path under /tmp. #}
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive NEEDRESTART_MODE=a
TORCHRIG_APT_WAIT={{ apt_wait }}
apt_wait() { python3 -c "$TORCHRIG_APT_WAIT" {{ lock_timeout }}; }
apt_get() { apt_wait; apt-get -q -y -o DPkg::Lock::Timeout={{ lock_timeout }} -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold "$@"; }
dpkg_run() { apt_wait; dpkg --force-confdef --force-confold "$@"; }
TORCHRIG_TMP=$(mktemp -d)
trap 'rm -rf -- "$TORCHRIG_TMP"' EXIT
