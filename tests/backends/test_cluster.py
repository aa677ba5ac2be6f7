"""Launcher conventions (backends/cluster.py): which process of a job a rank program is."""

from __future__ import annotations

import pytest

from pcompile.backends.cluster import IdentityError, resolve_identity


def ident(env: dict[str, str], **flags):
    return resolve_identity(flags.get("n"), flags.get("pid"), flags.get("coordinator"), env,
                            detect=False)


def test_nothing_set_is_one_process() -> None:
    got = ident({})
    assert (got.num_processes, got.process_id, got.source) == (1, 0, "single process")


def test_flags_and_pcompile_variables_come_first() -> None:
    torchrun = {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "9"}
    got = ident(torchrun, n=2, pid=0, coordinator="c:1")
    assert (got.num_processes, got.process_id, got.coordinator) == (2, 0, "c:1")
    got = ident({**torchrun, "PCOMPILE_NUM_PROCESSES": "8", "PCOMPILE_PROCESS_ID": "3",
                 "PCOMPILE_COORDINATOR": "node0:7777"})
    assert (got.num_processes, got.process_id, got.coordinator) == (8, 3, "node0:7777")


def test_torchrun() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1",
           "MASTER_PORT": "29500"}
    got = ident(env)
    assert (got.num_processes, got.process_id, got.coordinator) == (2, 1, "10.0.0.1:29500")
    assert "torchrun" in got.source
    # Under torchrun's elastic agent its TCPStore holds MASTER_PORT: the next port is ours.
    got = ident({**env, "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert got.coordinator == "10.0.0.1:29501"


def test_msrun_and_mindspore_variables() -> None:
    sched = {"MS_WORKER_NUM": "4", "MS_SCHED_HOST": "10.0.0.2", "MS_SCHED_PORT": "8118"}
    got = ident({**sched, "MS_ROLE": "MS_WORKER", "MS_NODE_ID": "3"})
    assert (got.num_processes, got.process_id, got.coordinator) == (4, 3, "10.0.0.2:8118")
    assert ident({**sched, "MS_ROLE": "MS_SCHED"}).scheduler
    with pytest.raises(IdentityError, match="MS_NODE_ID is unset"):
        ident({**sched, "MS_ROLE": "MS_WORKER"})
    got = ident({"RANK_ID": "2", "RANK_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "5"})
    assert (got.num_processes, got.process_id, got.coordinator) == (4, 2, "h:5")
    with pytest.raises(IdentityError, match="no coordinator address"):
        ident({"RANK_ID": "2", "RANK_SIZE": "4"})


def test_open_mpi_without_jax_detection_needs_a_coordinator() -> None:
    env = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"}
    with pytest.raises(IdentityError, match="PCOMPILE_COORDINATOR"):
        ident(env)
    got = ident({**env, "PCOMPILE_COORDINATOR": "n0:7"})
    assert (got.num_processes, got.process_id, got.coordinator) == (2, 1, "n0:7")


@pytest.mark.parametrize("env, message", [
    ({"WORLD_SIZE": "2"}, "RANK is not"),
    ({"RANK": "0"}, "WORLD_SIZE is not"),
    ({"RANK_SIZE": "8"}, "RANK_ID is not"),
    ({"WORLD_SIZE": "two", "RANK": "0"}, "not an integer"),
    ({"HOROVOD_SIZE": "4"}, "does not read"),
    ({"RANK": "0", "WORLD_SIZE": "2", "PMI_RANK": "1", "PMI_SIZE": "2", "MASTER_ADDR": "h",
      "MASTER_PORT": "1"}, "launchers disagree"),
    ({"RANK": "3", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "not in"),
])
def test_world_sizes_pcompile_cannot_use_are_refused(env, message) -> None:
    with pytest.raises(IdentityError, match=message):
        ident(env)
