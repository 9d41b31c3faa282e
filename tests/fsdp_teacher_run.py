"""Shard a teacher with FSDP2 over 2 CPU processes (gloo) and compare it with the unsharded teacher.

Run by tests/test_placement.py through torchrun. The Trainer only enables FSDP on accelerators (on a CPU
accelerate would run it as DDP, which DistillationTrainer refuses), so this exercises hf_distill's sharding
of the teacher directly: outputs and tapped features must equal the replica's, while each rank holds only
its shard of the parameters.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from helpers import collate, leave_distributed_run, teacher, token_dataset  # noqa: E402

from hf_distill.features.taps import FeatureTaps, TapRequest  # noqa: E402
from hf_distill.placement import local_parameter_bytes, shard_fsdp2  # noqa: E402


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    replica = teacher(layers=4).eval().requires_grad_(False)
    sharded = shard_fsdp2(copy.deepcopy(replica))
    batch = collate([token_dataset(6, seed=dist.get_rank())[i] for i in range(6)])
    batch.pop("labels")
    request = TapRequest(hidden={0, 2, 4}, q={2, 4}, k={2, 4}, v={4})
    results = {}
    with torch.no_grad():
        with FeatureTaps(replica, request).capture() as ref:
            ref_logits = replica(**batch).logits
        with FeatureTaps(sharded, request).capture() as got:
            got_logits = sharded(**batch).logits
    diffs = [(ref_logits - got_logits).abs().max().item()]
    for kind in ("hidden", "q", "k", "v"):
        for i, value in getattr(ref, kind).items():
            diffs.append((value - getattr(got, kind)[i]).abs().max().item())
    results = {
        "max_abs_diff": max(diffs),
        "features": sum(len(getattr(got, k)) for k in ("hidden", "q", "k", "v")),
        "replica_bytes": local_parameter_bytes(replica),
        "sharded_bytes": local_parameter_bytes(sharded),
        "world_size": dist.get_world_size(),
    }
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(gathered))
    # Both ranks leave together: a gloo rank tearing down while the other is still in a collective aborts.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    leave_distributed_run()
