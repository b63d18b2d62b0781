"""`rollmesh launch`: the plan, the supervisor, the hosts (local, SSH, Slurm), the watchdog and the console."""
