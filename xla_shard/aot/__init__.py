"""Ahead-of-time compile: the training step a config runs, compiled by the TPU compiler for a slice you do not
have, on a machine without a TPU (`xla-shard compile CONFIG --tpu v5p-64`).

libtpu compiles without a TPU: jax describes a slice's devices (`get_topology_desc`) and hands out a
compile-only client. The step is traced by torch_xla on as many virtual CPU devices as the slice has, through
the very code `xla-shard train` runs (`Trainer.step`, the backend's shardings), and its pending graph's
HloModuleProto is compiled for the slice: its memory per device, FLOPs, bytes and collectives are the TPU
compiler's own. target.py: which slice; trace.py: the step; compiler.py: libtpu; report.py: what a user needs
before renting.
"""
