{# The job's log and checkpoint folders, made by root safely (see jobdirs.py), for the
   systemd launcher (inside install.sh) and the Slurm one. #}
python3 -I - {{ dirs }} <<'TORCHRIG_PY'
{{ dirs_script }}
TORCHRIG_PY
