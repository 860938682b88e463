"""Sharing a cluster between training jobs in time slices (issue 40).

Pure (no torch, injectable clock): ``jobs`` (states and legal transitions, what a policy sees),
``policy`` (the policy contract and device placement), the policies, the trace reader and the
discrete-event simulator. Executors (local slots, Slurm) run real ``polytrain train`` jobs
through the CLI and keep their state in SQLite.
"""
