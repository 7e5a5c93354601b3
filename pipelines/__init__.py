"""The wiring of the two roles: the one loop with its sources and hooks, ray, offline,
placement, plan, bench, the commands, and the shipped YAML configs."""
