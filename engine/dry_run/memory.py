"""The parameter, gradient and optimizer bytes a rank holds, read from its tensors (real or meta) as
engine/memory_estimate.py counts them: distinct storages, so that views of one flat buffer count once."""
from __future__ import annotations

import dataclasses

from engine.memory_estimate import estimate
from parallel import comm


def storages(tensors) -> int:
    """Bytes of the distinct storages behind `tensors`, told apart by the storage object itself (every meta
    tensor's data pointer is 0)."""
    seen = {}
    for t in tensors:
        if t is not None:
            storage = t.untyped_storage()
            seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


def held_bytes(trainer) -> dict:
    """{parameters, gradients, optimizer, host} bytes of `trainer`'s rank, the gradients as the optimizer takes
    them and its state once it has stepped (stage 0: the parameters, their .grad, fp32 masters below fp32 and the
    moments; ZeRO: the units' flat buffers and shards and the sharded state); `host`: the state optim.offload_fraction
    keeps in host memory (masters, moments, gradient and staging buffers, spares), none of it in the others;
    `offload_overlap`: the optimizer's setting once "auto" is decided (engine/data_parallel.overlap_setting)."""
    dp, opt = trainer.data_parallel, trainer.optimizer
    units = getattr(dp, "units", None)
    if units is None:
        params = [p for _, p in trainer.named_params]
        weights, grads = storages(params), storages(p.grad for p in params)
        device = [(m, p) for i, (m, p) in enumerate(zip(opt.master, opt.params)) if i not in opt.host]
        state = [t for m, _ in device for k, t in opt.inner.state.get(m, {}).items() if k != "step"]
        optim = storages(state + [m for m, p in device if m is not p])
    else:
        stage = trainer.cfg.parallel.zero_stage
        held = [u.param_shard if stage == 3 else u.flat for u in units]
        weights = storages(held)
        grads = sum(storages([u.full_grad, u.full_grad32, u.grad_shard, u.grad32]) for u in units)
        optim = storages(held + opt.held_tensors()) - weights  # an fp32 stage-3 master is the shard itself
    return {"parameters": weights, "gradients": grads, "optimizer": optim, "host": storages(opt.host_tensors()),
            "shard_rank": comm.group_rank(dp.shard_group) if units is not None else 0,
            "offload_overlap": opt.cfg.offload_overlap}


def estimated_bytes(cfg, world_size: int, stage: int, shard_rank: int, offload_overlap: str | None = None) -> dict:
    """engine/memory_estimate.py's figures for the rank of pipeline stage `stage` and ZeRO shard `shard_rank`, for
    the optim.offload_overlap the rank's optimizer runs with (the estimate counts "auto" as speculating, the
    larger host figure; the optimizer may have decided "false" from the device's time model)."""
    if offload_overlap is not None:
        cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, offload_overlap=offload_overlap))
    want = estimate(cfg, world_size, shard_rank)[stage]
    return {"parameters": want.parameters, "gradients": want.gradients, "optimizer": want.optimizer,
            "host": want.host, "activations": want.activations}
