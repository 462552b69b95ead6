"""The long-lived worker process: the RQ worker, its context, one shard's run against the store, containment.

Owns: the RQ worker (rq_worker.py: drain, heartbeat, claims), the process's context (context.py: store, engine,
stop flags), running one shard (shard.py: pending requests in, each result committed at once), containing engine
failures to the request that caused them (containment.py), waiting out a database restart (reconnect.py), what
the worker says at INFO (report.py), and Redis's reconnect noise cut to one line per outage (reconnects.py). The
RQ entry point itself is worker/entry.py (its import path is a wire format).
"""
