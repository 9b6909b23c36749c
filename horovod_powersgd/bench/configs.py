"""The benchmark's configurations, listed once: the driver (`__main__`), the worker, the
paired harness and the targets all read these (pure: nothing to import).

`python -m horovod_powersgd.bench --help` says what each one runs.
"""

# Run under Horovod (mpirun / horovodrun), one process per worker.
HOROVOD_CONFIGS = (
    "horovod",
    "horovod-fp16",
    "powersgd",
    "powersgd-fp16",
    "powersgd-1round",
    "powersgd-1round-fp16",
    "powersgd-nostats",
    # The library with nothing compressed (min_compression_rate=1e12): beside plain
    # Horovod, the fixed cost it adds to a step.
    "powersgd-none",
    # hierarchical=True: exact in the node, compressed between nodes (hierarchy.py).
    "powersgd-hier",
    # rank="auto": plans per bucket from this job's measurements (untimed warm-up
    # steps measure, try and settle first: worker.AUTO_WARMUP_STEPS at least).
    "powersgd-auto",
    "powersgd-1round-auto",
    # hierarchical="auto" with rank="auto": auto chooses flat or hierarchical too.
    "powersgd-hier-auto",
    # rounds=2 with each bucket's Q sent alone as its P comes back, the order before
    # 5a4e37f (bench/ablation.py): beside "powersgd", what grouping the Q's changes.
    "powersgd-qbyq",
)
# torch DistributedDataParallel: cannot share a process with Horovod.
DDP_CONFIGS = ("ddp", "ddp-powersgd")
CONFIGS = ("local", *HOROVOD_CONFIGS, *DDP_CONFIGS)
# Those that run at a PowerSGD rank ("name:r" in --configs; a record carries the rank, a
# target names it): the fixed-rank PowerSGD of the library and of torch's DDP hook.
RANKED = (
    "powersgd",
    "powersgd-fp16",
    "powersgd-1round",
    "powersgd-1round-fp16",
    "powersgd-nostats",
    "powersgd-hier",
    "powersgd-qbyq",
    "ddp-powersgd",
)
