{# Every step that changes $base holds this lock, so two launches pushing to one node at once
   both succeed: the second finds the release complete, or builds its own in a private folder
   and renames it in. #}
{% set lock_dir = shell('"$base"') %}
{% set lock_holder = shell("another push to $base held its lock") %}
{% set lock_code = 1 %}
{% include "lib/lock.sh" %}
