{# Install, start and undo on a node hold this lock (a 0600 file of root's in the jobs
   folder), so two launches at once see each other's units complete and in a known state. #}
{% set lock_dir = jobs %}
{% set lock_holder = shell("another launch held the lock on " ~ jobs|q) %}
{% set lock_code = 3 %}
{% include "lib/lock.sh" %}
