"""The torch.distributed environment of a rank, derived from each launcher's variables
(Slurm, torchrun, Open MPI, MPICH/Intel MPI), hostlists, and the file rendezvous."""

from __future__ import annotations

import shutil
import subprocess
import threading

import pytest

from realscale.launcher.dist_env import (DistEnv, DistEnvError, derive, expand_hostlist, job_key, rendezvous,
                                         slurm_hostnames)


def test_torchrun_variables_win() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "n1",
           "MASTER_PORT": "29500", "SLURM_PROCID": "0", "SLURM_STEP_ID": "2", "SLURM_NTASKS": "1"}
    assert derive(env) == DistEnv(3, 4, 1, 2, "n1", 29500, "torchrun")


def test_slurm_step_variables() -> None:
    env = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "1", "SLURM_PROCID": "5", "SLURM_NTASKS": "99",
           "SLURM_STEP_NUM_TASKS": "6", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
           "SLURM_STEP_TASKS_PER_NODE": "2(x2),1", "SLURM_STEP_NODELIST": "gpu[07-09]", "SLURM_JOB_NODELIST": "x"}
    d = derive(env)
    # the step's task count (not the allocation's), the step's first node as master
    assert (d.rank, d.world_size, d.local_rank, d.local_world_size) == (5, 6, 1, 1)
    assert d.master_addr == "gpu07" and d.master_port is None and d.source == "slurm"
    assert job_key(env) == "slurm-77.0.1"
    assert job_key({**env, "SLURM_RESTART_COUNT": "2"}) == "slurm-77.2.1"


def test_batch_script_is_not_a_rank() -> None:
    """The batch step has SLURM_PROCID / SLURM_NTASKS of the allocation but no step id."""
    env = {"SLURM_JOB_ID": "77", "SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "n[1-2]"}
    assert derive(env).source == "single" and derive(env).world_size == 1


def test_openmpi_and_pmi_variables() -> None:
    ompi = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert derive(ompi) == DistEnv(2, 4, 0, 2, None, None, "openmpi")
    pmi = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "MASTER_ADDR": "h",
           "MASTER_PORT": "1234"}
    assert derive(pmi) == DistEnv(1, 2, 1, 2, "h", 1234, "pmi")


def test_bad_values_are_named() -> None:
    with pytest.raises(DistEnvError, match="SLURM_PROCID='x'"):
        derive({"SLURM_STEP_ID": "0", "SLURM_PROCID": "x", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "n1"})
    with pytest.raises(DistEnvError, match="SLURM_STEP_TASKS_PER_NODE"):
        derive({"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "n1",
                "SLURM_STEP_TASKS_PER_NODE": "two"})
    with pytest.raises(DistEnvError, match="not known yet"):
        DistEnv(0, 2, 0, 2, None, None, "openmpi").exported()


def test_expand_hostlist() -> None:
    assert expand_hostlist("gpu[01-03,7],login1") == ["gpu01", "gpu02", "gpu03", "gpu7", "login1"]
    assert expand_hostlist("a[08-10]-ib") == ["a08-ib", "a09-ib", "a10-ib"]
    assert expand_hostlist("n[1-2]r[1-2]") == ["n1r1", "n1r2", "n2r1", "n2r2"]
    with pytest.raises(DistEnvError, match="unbalanced"):
        expand_hostlist("gpu[01-03")
    with pytest.raises(DistEnvError, match="range 'a-b'"):
        expand_hostlist("gpu[a-b]")


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="scontrol not installed (bash .ci/slurm_up.sh)")
def test_expansion_matches_scontrol() -> None:
    probe = subprocess.run(["scontrol", "show", "hostnames", "vm"], capture_output=True, text=True)
    if probe.returncode != 0:  # installed (e.g. by .ci/cluster_up.sh) but no slurm.conf to read
        pytest.skip(f"scontrol cannot run here: {(probe.stderr.strip().splitlines() or ['?'])[-1]}")
    for text in ("gpu[01-03,7],login1", "n[1-2]r[1-2]", "node[098-101]", "vm"):
        ref = subprocess.run(["scontrol", "show", "hostnames", text], capture_output=True, text=True).stdout.split()
        assert expand_hostlist(text) == ref == slurm_hostnames(text), text


def test_file_rendezvous_gives_every_rank_rank0s_port(tmp_path) -> None:
    path = str(tmp_path / "rdzv" / "job")
    got: dict[int, DistEnv] = {}

    def rank(r: int) -> None:
        got[r] = rendezvous(DistEnv(r, 3, r, 3, "nodeA", None, "slurm"), path, timeout=30)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (2, 1, 0)]  # the others wait for rank 0
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    ports = {d.master_port for d in got.values()}
    assert len(got) == 3 and len(ports) == 1 and None not in ports
    assert {d.master_addr for d in got.values()} == {"nodeA"}
    assert got[1].exported()["MASTER_PORT"] == str(got[0].master_port)


def test_rendezvous_times_out_with_a_clear_error(tmp_path) -> None:
    with pytest.raises(DistEnvError, match="did not publish its address"):
        rendezvous(DistEnv(1, 2, 1, 2, None, None, "openmpi"), str(tmp_path / "never"), timeout=0.3)


def _step_env(procid: int, **extra: str) -> dict[str, str]:
    """A trainer task of a two-node Slurm step (one task per node)."""
    return {"SLURM_JOB_ID": "41", "SLURM_STEP_ID": "2", "SLURM_PROCID": str(procid), "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_LOCALID": "0", "SLURM_NODEID": str(procid), "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
            "SLURM_STEP_NODELIST": "cn[1-2]", "SLURM_JOB_NUM_NODES": "2", "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1",
            **extra}


def test_multi_node_ranks_publish_an_address_and_bind_gloo_to_its_interface(tmp_path) -> None:
    """Across nodes, rank 0 publishes its node's address (the Slurm node name ``cn1`` may
    not resolve: here it does not), every rank advertises its own and binds gloo to the
    interface that holds it (the route to the node srun ran on: loopback here)."""
    from realscale.launcher.roles import bootstrap

    envs = {r: _step_env(r) for r in (0, 1)}
    got = {}
    threads = [threading.Thread(target=lambda r=r: got.__setitem__(r, bootstrap(str(tmp_path), envs[r])))
               for r in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got[0].master_addr == got[1].master_addr == "127.0.0.1" and got[0].master_port == got[1].master_port
    for env in envs.values():
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["REALSCALE_ADVERTISE_HOST"] == "127.0.0.1"
        assert env["GLOO_SOCKET_IFNAME"] == "lo"
    # launch.env wins (GLOO_SOCKET_IFNAME, MASTER_ADDR), and a one-node job is left as it was
    env = _step_env(0, GLOO_SOCKET_IFNAME="ib0", MASTER_ADDR="10.9.9.9", MASTER_PORT="29400")
    assert bootstrap(str(tmp_path), env).master_addr == "10.9.9.9" and env["GLOO_SOCKET_IFNAME"] == "ib0"
    one = {**_step_env(0), "SLURM_JOB_NUM_NODES": "1", "SLURM_STEP_TASKS_PER_NODE": "2",
           "SLURM_STEP_NODELIST": "cn1", "SLURM_JOB_ID": "42"}
    assert bootstrap(str(tmp_path), one).master_addr == "cn1" and "GLOO_SOCKET_IFNAME" not in one


def test_a_server_of_a_multi_node_job_advertises_its_address(monkeypatch: pytest.MonkeyPatch) -> None:
    from realscale.launcher.roles import node_network
    from realscale.parallel.net import advertised_host

    env = {"SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1"}
    assert node_network(env, None) == "127.0.0.1" and env["GLOO_SOCKET_IFNAME"] == "lo"
    assert node_network({}, None) is None and node_network({}, "no-such-host.invalid") is None
    monkeypatch.setenv("REALSCALE_ADVERTISE_HOST", "10.1.2.3")
    assert advertised_host("0.0.0.0") == "10.1.2.3" and advertised_host("10.0.0.5") == "10.0.0.5"
