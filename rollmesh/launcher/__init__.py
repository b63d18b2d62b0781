"""`rollmesh launch`: the plan, the supervisor, the hosts (local, SSH, Slurm), the watchdog and the console.

    plan        build_plan, print_plan: every process of the cluster file and what it is handed
    launcher    the Launcher: run directory, start, supervise, status hub, summary.json
    commands    the CLI mains: `rollmesh launch` (main), `rollmesh status`, `rollmesh stop`
    supervisor  the role processes the launcher spawns, their handshake and heartbeats
    hosts       where a process runs: this machine, over SSH (host_kinds.make_host picks)
    slurm       a cluster file's [slurm]: job steps, `--sbatch`
    watchdog    the progress watchdog's rule (no trainer step while samples drop)
    console     what the user sees: the progress bar and event lines
"""
