"""Every rank must see the run directory rank 0 writes (`distributed.check_shared_directory`): a rank whose path
is on storage of its own (a node-local disk) is named, on every rank, before anything trains. Two gloo ranks on
this machine, rank 1 given another directory as a node-local disk would give it."""

import socket

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, dirs: list[str], results: str) -> None:
    from pathlib import Path

    from pretrain.core.errors import UserError
    from pretrain.train.distributed import check_shared_directory

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        check_shared_directory(dirs[rank], "the run directory")
        said = "ok"
    except UserError as err:
        said = str(err)
    finally:
        dist.destroy_process_group()
    Path(results, f"rank{rank}").write_text(said)


@pytest.mark.parametrize("shared", [True, False])
def test_a_rank_that_does_not_see_rank_0s_run_directory_is_named_on_every_rank(tmp_path, shared):
    node0, node1 = tmp_path / "node0" / "run", tmp_path / "node1" / "run"
    node0.mkdir(parents=True)
    node1.mkdir(parents=True)
    dirs = [str(node0), str(node0 if shared else node1)]
    mp.start_processes(_rank, args=(_port(), dirs, str(tmp_path)), nprocs=2, start_method="spawn")
    said = [(tmp_path / f"rank{r}").read_text() for r in range(2)]
    if shared:
        assert said == ["ok", "ok"]
    else:
        assert said[0] == said[1] and said[0].startswith(f"rank 1 on {socket.gethostname()} cannot see the run")
        assert "a file system every node mounts" in said[0]
    assert sorted(p.name for p in node0.iterdir()) == []  # the token is gone
