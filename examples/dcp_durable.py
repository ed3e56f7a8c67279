"""Plain torch.distributed.checkpoint with ddpstate's durable writer and verified reader.

An FSDP2 model and its optimizer are saved with ``dcp.save`` through
``ddpstate.dcp.DurableWriter`` (every item CRC-32'd as it is written, a manifest
written last as the commit, the folder swapped into place), then loaded back
into a fresh model with ``dcp.load`` through ``VerifiedReader`` (every byte range
checked as it is read). Runs on the CPU (gloo):

    torchrun --standalone --nproc-per-node=2 examples/dcp_durable.py --out /tmp/ckpt

``--out`` may be an fsspec URL (``s3://bucket/run/ckpt``, with s3fs installed);
``--storage-options '{"endpoint_url": "http://127.0.0.1:9000"}'`` passes options.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ddpstate.dcp import DurableWriter, VerifiedReader


def build(world: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", default="runs/dcp_durable/step_10")
    parser.add_argument("--storage-options", type=json.loads, default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    model, opt = build(world, seed=0)
    for _ in range(3):  # a few training steps: the optimizer has state to save
        opt.zero_grad()
        model(torch.randn(8, 16)).pow(2).mean().backward()
        opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd, "step": 10}
    dcp.save(state, storage_writer=DurableWriter(args.out, storage_options=args.storage_options))

    fresh, fresh_opt = build(world, seed=1)  # other weights, no optimizer state
    model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
    loaded = {"model": model_sd, "optim": optim_sd, "step": 0}
    reader = VerifiedReader(args.out, storage_options=args.storage_options)
    dcp.load(loaded, storage_reader=reader)
    set_state_dict(
        fresh, fresh_opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"]
    )
    same = all(
        torch.equal(a.full_tensor(), b.full_tensor())
        for a, b in zip(model.parameters(), fresh.parameters(), strict=True)
    )
    if rank == 0:
        listed = sorted(os.listdir(args.out)) if "://" not in args.out else "(remote)"
        print(f"saved and verified {args.out} {listed}: step {loaded['step']}, same={same}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
