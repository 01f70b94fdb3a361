"""kt.dist on a host's torch.distributed process group (gloo, two processes):
owner-rank and expert-parallel layers give one process's bits for the same
tokens, and torch autograd's values within the fp32 bounds."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers.cases import make_case
from helpers.reference import reference_grads, rel_l2
from helpers.tolerances import FP32

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


def _checkpoint_main(rank, world, init_file, ckpt_dir):
    import kt
    from kt.dist import Communicator, DistMoE, LayerOptimizer, load_checkpoint, save_checkpoint

    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
    try:
        r = 4
        case = make_case(E, K, H, I, sum(TOKENS), mode="inference", seed=5)
        w, x, ids, rw, dy = case["w"], case["x"], case["ids"], case["weights"], case["dy"]
        gen = torch.Generator().manual_seed(9)
        lora = {"LORA_A_GATE": torch.randn(E, r, H, generator=gen) * 0.1,
                "LORA_B_GATE": torch.randn(E, I, r, generator=gen) * 0.1,
                "LORA_A_UP": torch.randn(E, r, H, generator=gen) * 0.1,
                "LORA_B_UP": torch.randn(E, I, r, generator=gen) * 0.1,
                "LORA_A_DOWN": torch.randn(E, r, I, generator=gen) * 0.1,
                "LORA_B_DOWN": torch.randn(E, H, r, generator=gen) * 0.1}
        engine = kt.Engine(num_threads=1, pin_threads=False)

        def bind(layer, experts, values):
            sel = torch.tensor(experts, dtype=torch.int64)
            params = {k: (v[sel].clone() if values else torch.zeros_like(v[sel])) for k, v in lora.items()}
            grads = {"GRAD_" + k: torch.zeros_like(v) for k, v in params.items()}
            layer.bind(**params, **grads)
            return params

        # One process, two steps: the oracle.
        one = kt.MoE(E, K, H, I, max_tokens=sum(TOKENS), mode="lora", lora_rank=r, lora_alpha=8.0, engine=engine)
        one.load_weights(gate=w["gate"], up=w["up"], down=w["down"])
        ref = bind(one, list(range(E)), True)
        ref_opt = LayerOptimizer(one, lr=1e-2)
        for _ in range(2):
            ctx = one.forward(x, ids, rw, torch.empty_like(x), save=True)
            one.backward(ctx, dy)
            ctx.release()
            ref_opt.step()

        comm = Communicator.from_process_group(timeout=20.0)
        t0 = sum(TOKENS[:rank])
        rows = slice(t0, t0 + TOKENS[rank])
        xr, idr, rwr, dyr = x[rows].contiguous(), ids[rows].contiguous(), rw[rows].contiguous(), dy[rows].contiguous()

        def make(expert_ranks, values):
            layer = DistMoE(comm, E, K, H, I, max_tokens=max(TOKENS), mode="expert_parallel",
                            expert_ranks=expert_ranks, layer_mode="lora", lora_rank=r, lora_alpha=8.0,
                            engine=engine)
            mine = layer.local_experts()
            sel = torch.tensor(mine, dtype=torch.int64)
            if values:
                layer.layer.load_weights(gate=w["gate"][sel].contiguous(), up=w["up"][sel].contiguous(),
                                         down=w["down"][sel].contiguous())
            params = bind(layer.layer, mine, values)
            return layer, mine, params, LayerOptimizer(layer.layer, lr=1e-2)

        layer, mine, params, opt = make(None, True)
        for _ in range(2):
            ctx = layer.forward(xr, idr, rwr, torch.empty_like(xr), save=True)
            layer.backward(ctx, dyr)
            ctx.release()
            opt.step()
        seen = []
        save_checkpoint(comm, ckpt_dir, {5: (layer, opt)}, progress=lambda done, total: seen.append((done, total)))
        assert seen and seen[-1][0] == seen[-1][1] > 0

        # Another expert map, empty layers: everything comes from the checkpoint.
        layer2, mine2, params2, opt2 = make([(e + 1) % world for e in range(E)], False)
        assert mine2 != mine
        load_checkpoint(comm, ckpt_dir, {5: (layer2, opt2)})
        assert opt2.steps == 2
        for k, v in params2.items():
            assert torch.equal(v, ref[k][mine2]), "%s differs from the uninterrupted run's" % k
        y = torch.empty_like(xr)
        layer2.forward(xr, idr, rwr, y)
        y_one = torch.empty_like(x)
        one.forward(x, ids, rw, y_one)
        assert torch.equal(y, y_one[rows])

        # A layer of another shape is refused on every rank.
        wrong = DistMoE(comm, E, K, H, I + 8, max_tokens=max(TOKENS), mode="expert_parallel", layer_mode="lora",
                        lora_rank=r, lora_alpha=8.0, engine=engine)
        with pytest.raises(kt.ShapeError, match="rank 0: .*intermediate \\(I\\) = 24, this layer has 32"):
            load_checkpoint(comm, ckpt_dir, {5: wrong})
        with pytest.raises(ValueError, match="parts"):
            save_checkpoint(comm, ckpt_dir, {5: layer}, parts={"everything"})
        for o in (opt, opt2):
            o.close()
        for lay in (layer, layer2, wrong):
            lay.close()
        comm.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not _have_gloo(), reason="kt built without Gloo")
def test_distributed_checkpoint_resumes_on_another_expert_map_bit_identical():
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_checkpoint_main, args=(2, os.path.join(d, "init"), os.path.join(d, "ckpt")), nprocs=2, join=True)
