set -eu
tb={{ tb }}
[ -x "$tb" ] || { echo "error: TensorBoard is not installed in {{ venv }} on this node: set var \
tensorboard: true for it and run torchrig provision" >&2; exit 3; }
# checked as the job's user: root follows no path in the job's folder
runuser -u {{ user }} -- test -d {{ logdir }} || { echo "error: no TensorBoard folder {{ logdir }} on this \
node: was job {{ job }} launched with var tensorboard set (and has it started logging)?" >&2; exit 3; }
systemd-run --quiet --collect --unit={{ unit }} --uid={{ user }} -p NoNewPrivileges=yes \
  --setenv=PYTHONUNBUFFERED=1 --description={{ desc }} -- \
  "$tb" --logdir {{ logdir }} --host 127.0.0.1 --port {{ port }}
