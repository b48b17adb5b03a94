"""Every rank agrees: found-inf agreement and global gradient norms over a process group.

With DDP every rank holds the same all-reduced gradients, so every rank finds the same inf. With
sharded gradients (FSDP1, FSDP2/DTensor, ZeRO-style optimizers, tensor parallel) each rank checks
only its own shard, and a per-rank decision makes replicas diverge or collectives hang. A
:class:`~mixprec.GradScaler` built with ``process_group=group`` (or one whose gradients are
DTensors) therefore turns each optimizer's local found-inf flag into a global one with **one MAX
all-reduce per optimizer per iteration**, on every path (``unscale_``, plain ``step``, fused
optimizers), waited for before anything reads it. The flag stays 0-d (shape ``()``), as torch's
fused optimizers require.

What lives here:

* :func:`agree_found_inf_`: the all-reduce itself (also what a clipping routine calls).
* :func:`all_reduce_norm_` and :func:`distributed_clip_grad_norm_`: the global norm of sharded
  gradients with one all-reduce.
* :class:`DistState`: the per-scaler bookkeeping the GradScaler calls (not public).

Modules: ``agree`` (the flag), ``norms`` (clipping). Nothing here knows about the scaler:
``JoinableScaler`` (uneven inputs) lives in ``mixprec._src.scaling.join`` and is public through
:mod:`mixprec.distributed`.

See ``docs/distributed.md`` for usage with DDP, FSDP1/FSDP2 and torchrun.
"""
