"""The rollouter's rules, without sockets (the role is `rollmesh.rollout.role`).

As `mq.store.MessageQueue` holds the queue's rules apart from its server, this package
holds the rollouter's state and rules as plain objects that tests drive directly:

    core.RolloutCore    capacity (AReaL's staleness bound), admission, dispatch, returned and
                        scored trajectories, group completion, pause bookkeeping; it returns
                        actions (`core.Send`: what to send to which worker) and never sends
    journal.Journal     the rollouter's journal: its records and the one path that applies
                        them, live and on replay (the counters of the accounting identity)
    filters             the group filters (`dapo_filter`, ...)
    eval_round.EvalRounds  the evaluation rounds of the held-out set
    workers.WorkerPool  the registered workers and what is out with each
"""
