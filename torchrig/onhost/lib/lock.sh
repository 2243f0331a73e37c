{# An exclusive lock on <lock_dir>/.lock for the rest of the script, waiting up to 300 s; on
   timeout `error: <lock_holder> for 300 s` and exit <lock_code>. The lock file is root's,
   0600: a lock on the 0755 folder itself could be taken, and held, by any local user. #}
old_umask=$(umask); umask 077; exec 9>>{{ lock_dir }}/.lock; umask "$old_umask"
flock -w 300 9 || { echo "error: {{ lock_holder }} for 300 s" >&2; exit {{ lock_code }}; }
