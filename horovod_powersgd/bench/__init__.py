"""Benchmark: PowerSGD against plain Horovod, Horovod fp16 and PyTorch's DDP PowerSGD hook.

Run ``python -m horovod_powersgd.bench --help`` (or ``horovod-powersgd-bench``).
The driver starts the workers itself, one configuration after another, and can
run them all inside a network namespace with a capped loopback (``--bandwidth``).
"""
