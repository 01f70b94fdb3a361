"""kt.dist on a host's torch.distributed process group (gloo, two processes):
owner-rank and expert-parallel layers give one process's bits for the same
tokens, and torch autograd's values within the fp32 bounds."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cases import make_case
from reference import reference_grads, rel_l2
from tolerances import FP32

E, K, H, I = 6, 2, 32, 24
TOKENS = [5, 3]  # per rank


def _rank_main(rank, world, init_file, mode):
    import kt
    from kt.dist import Communicator, DistMoE

    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
    try:
        case = make_case(E, K, H, I, sum(TOKENS), mode="inference", seed=3)
        w, x, ids, rw, dy = case["w"], case["x"], case["ids"], case["weights"], case["dy"]
        engine = kt.Engine(num_threads=1, pin_threads=False, precision="fp32")

        # One process over every rank's tokens: the oracle.
        one = kt.MoE(E, K, H, I, max_tokens=sum(TOKENS), mode="full", engine=engine)
        one.load_weights(gate=w["gate"], up=w["up"], down=w["down"])
        ref_grads = {p: torch.zeros_like(w[p]) for p in ("gate", "up", "down")}
        one.bind(GRAD_W_GATE=ref_grads["gate"], GRAD_W_UP=ref_grads["up"], GRAD_W_DOWN=ref_grads["down"])
        y1, dx1, dw1 = torch.empty_like(x), torch.empty_like(x), torch.empty_like(rw)
        ctx = one.forward(x, ids, rw, y1, save=True)
        one.backward(ctx, dy, dx1, dw1, grad_scale=1.0 / world)
        ctx.release()
        y_ref, g_ref = reference_grads(x, ids, rw, w, dy)
        assert rel_l2(y1, y_ref) < FP32

        # The ranks, on the process group's own store and ranks.
        comm = Communicator.from_process_group(timeout=20.0)
        assert comm.info()["world_size"] == world and comm.info()["rank"] == rank
        layer = DistMoE(comm, E, K, H, I, max_tokens=max(TOKENS), mode=mode, grad_average="mean",
                        layer_mode="full", engine=engine)
        mine = layer.local_experts()
        grads = {}
        if layer.layer is not None:
            sel = torch.tensor(mine, dtype=torch.int64)
            layer.layer.load_weights(gate=w["gate"][sel].contiguous(), up=w["up"][sel].contiguous(),
                                     down=w["down"][sel].contiguous())
            grads = {p: torch.zeros(len(mine), *w[p].shape[1:]) for p in ("gate", "up", "down")}
            layer.layer.bind(GRAD_W_GATE=grads["gate"], GRAD_W_UP=grads["up"], GRAD_W_DOWN=grads["down"])
        elif mode == "owner":
            assert rank != 0 and mine == []
        t0 = sum(TOKENS[:rank])
        rows = slice(t0, t0 + TOKENS[rank])
        xr, idr, rwr, dyr = x[rows].contiguous(), ids[rows].contiguous(), rw[rows].contiguous(), dy[rows].contiguous()
        y, dx, dw = torch.empty_like(xr), torch.empty_like(xr), torch.empty_like(rwr)
        dctx = layer.forward(xr, idr, rwr, y, save=True)
        layer.backward(dctx, dyr, dx, dw)
        dctx.release()
        assert torch.equal(y, y1[rows]), "y differs from one process's"
        assert torch.equal(dx, dx1[rows]), "dx differs from one process's"
        assert torch.equal(dw, dw1[rows]), "routing-weight gradients differ from one process's"
        for p, g in grads.items():
            assert torch.equal(g, ref_grads[p][mine]), "gradient of %s differs from one process's" % p
            # torch autograd over all ranks' tokens, averaged over the ranks.
            assert rel_l2(g, g_ref[p][mine] / world) < FP32
        assert rel_l2(dx, g_ref["x"][rows]) < FP32

        # An error on one rank is raised on every rank with its message.
        bad = idr.clone()
        if rank == 1:
            bad[0, 0] = E
        with pytest.raises(kt.ExpertIdError, match="rank 1: .*is outside"):
            layer.forward(xr, bad, rwr, y)
        layer.close()
        comm.close()
    finally:
        dist.destroy_process_group()


def _have_gloo():
    import kt
    return "gloo" in kt.build_info()


@pytest.mark.skipif(not _have_gloo(), reason="kt built without Gloo")
@pytest.mark.parametrize("mode", ["owner", "expert_parallel"])
def test_dist_layer_on_a_torch_process_group_matches_one_process(mode):
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_rank_main, args=(2, os.path.join(d, "init"), mode), nprocs=2, join=True)


def test_backend_strings():
    from kt.dist import parse_backend
    import kt
    assert parse_backend("cuda:nccl,cpu:gloo") == {"cpu": "gloo", "cuda": "nccl", "device": "cuda"}
    assert parse_backend("gloo") == {"cpu": "gloo", "cuda": None, "device": "cpu"}
    with pytest.raises(kt.InvalidArgumentError, match="'mpi' is not a backend"):
        parse_backend("mpi")
