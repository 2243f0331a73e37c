"""Out-of-band power control through each host's BMC (`torchrig power`): plan (pure: which
hosts, which BMC, what to do), ipmi (pure: ipmitool's command line and its replies), run (the
calls, concurrently, the password in the child's environment only)."""
