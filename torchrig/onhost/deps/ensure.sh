{# A job environment for a user's project on this node: a venv at <envs>/<h> that sees the
   provisioned torch venv's packages (a .pth line: torch, its CUDA wheels and NCCL are shared,
   never reinstalled), with the project's requirements (stdin) installed by pip. Built once per
   content hash, in place (a venv is not relocatable), marked complete last; an incomplete one
   is removed and built again. Prints `cached` or `built`, then the package set the
   environment resolves now and the one recorded when it was built. The requirements come
   base64-encoded in the script (which is itself stdin): never in a command line. #}
set -euo pipefail
envs={{ envs }}
env="$envs/"{{ h }}
mkdir -p "$envs" && chmod 755 "$envs"
{% include "deps/lock.sh" %}
if [ -f "$env/.complete" ]; then
  touch "$env"   # in use now: the sweep below keeps it
  state=cached
else
  rm -rf -- "$env"
  TORCHRIG_TMP=$(mktemp -d)
  trap 'rm -rf -- "$TORCHRIG_TMP"; [ -f "$env/.complete" ] || rm -rf -- "$env"' EXIT
  printf %s {{ requirements }} | base64 -d > "$TORCHRIG_TMP/requirements.txt"
  # no pip of its own (ensurepip costs more than the install itself): the torch venv's pip
  # installs into it (pip --python)
  {{ venv }}/bin/python -m venv --without-pip "$env"
  base_site=$({{ venv }}/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  site=$("$env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  printf '%s\n' "$base_site" > "$site/_torchrig_torch_venv.pth"
{% if netrc %}
  # the index's credentials: a 0600 file in the private folder, never a command line
  (umask 077; printf %s {{ netrc }} | base64 -d > "$TORCHRIG_TMP/netrc")
  export NETRC="$TORCHRIG_TMP/netrc"
{% endif %}
  pip() { {{ venv }}/bin/python -m pip --python "$env/bin/python" --disable-pip-version-check --no-input "$@"; }
  # what pip would install first: nothing of the provisioned stack may be replaced
  pip install --quiet --dry-run --report "$TORCHRIG_TMP/report.json" {{ pip_args }} -r "$TORCHRIG_TMP/requirements.txt"
  python3 -I -c {{ protected_check }} "$TORCHRIG_TMP/report.json" {{ allow_torch_change }}
  pip install --quiet {{ pip_args }} -r "$TORCHRIG_TMP/requirements.txt"
  "$env/bin/python" -c {{ list_packages }} > "$env/.packages"
  touch "$env/.complete"
  state=built
fi
echo "$state"
"$env/bin/python" -c {{ list_packages }}
echo "--- recorded"
cat "$env/.packages"
# keep the 5 newest environments, any used in the last hour (a launch may be between this and
# writing its unit) and any a unit runs (a job that runs, or may run again)
cd "$envs" && ls -1t | tail -n +6 | while read -r old; do
  [ -z "$(find "$old" -maxdepth 0 -mmin -60)" ] || continue
  grep -qsF -- "$envs/$old/" /etc/systemd/system/torchrig-*.service || rm -rf -- "$old"
done
