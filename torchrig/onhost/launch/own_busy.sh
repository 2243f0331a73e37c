{# Refuses when the job's own unit is busy: a launch of the same job started it meanwhile. #}
case "$(systemctl show -p ActiveState --value {{ name }})" in
  {{ running_states }})
    echo "error: job {{ job }} was started on this node meanwhile (another launch at the same time?)" >&2
    exit 3;;
esac
