"""Pipeline parallelism: schedules as data, stage partitioning, and the runtime that interprets them.

GPipe (Huang et al. 2019) fill-drain, PipeDream-flush 1F1B (Narayanan et al. 2021) and
asynchronous PipeDream with weight stashing (Narayanan et al. SOSP 2019). The pure schedule IR
lives in `polytrain.pipeline.schedule` and imports no torch.
"""
