{# Every step that changes the job environments' folder holds this lock: two launches needing
   the same environment on one node build it once (the second finds it complete). #}
{% set lock_dir = shell('"$envs"') %}
{% set lock_holder = shell("another launch building a job environment in $envs held its lock") %}
{% set lock_code = 1 %}
{% include "lib/lock.sh" %}
