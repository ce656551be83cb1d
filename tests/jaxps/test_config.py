"""Config: arguments first, JAXPS_* environment second, then defaults."""

import pytest

from jaxps import Config, errors


def test_defaults():
    cfg = Config()
    assert cfg.servers == () and cfg.num_workers == 1
    # chosen by the ranks at init (jaxps._src.tuning), and the credit with it
    assert cfg.partition_bytes == "auto" and cfg.credit_bytes is None
    assert cfg.largest_partition == 4 * 1024 * 1024
    env = {"JAXPS_PARTITION_BYTES": "auto", "JAXPS_CREDIT_BYTES": "5000"}
    cfg = Config.from_env(env)
    assert cfg.partition_bytes == "auto" and cfg.credit_bytes == 5000
    assert Config.from_env(env, partition_bytes=4096).partition_bytes == 4096


def test_credit_follows_the_partition_unless_given():
    assert Config(partition_bytes=1000).credit_bytes == 4000
    env = {"JAXPS_PARTITION_BYTES": "2048"}
    assert Config.from_env(env).credit_bytes == 8192
    env["JAXPS_CREDIT_BYTES"] = "5000"
    assert Config.from_env(env).credit_bytes == 5000
    assert Config.from_env(env, credit_bytes=7).credit_bytes == 7
    with pytest.raises(errors.ConfigError, match="credit_bytes must be"):
        Config(credit_bytes=0)


def test_environment_and_precedence():
    env = {
        "JAXPS_SERVERS": "a:1, b:2",
        "JAXPS_NUM_WORKERS": "4",
        "JAXPS_WORKER_RANK": "3",
        "JAXPS_TIMEOUT": "2.5",
        "JAXPS_PARTITION_BYTES": "1024",
    }
    cfg = Config.from_env(env)
    assert cfg.servers == ("a:1", "b:2")
    assert (cfg.num_workers, cfg.worker_rank) == (4, 3)
    assert cfg.timeout == 2.5 and cfg.partition_bytes == 1024
    cfg = Config.from_env(env, worker_rank=1, servers=["c:3"])
    assert cfg.worker_rank == 1 and cfg.servers == ("c:3",)


@pytest.mark.parametrize(
    "settings, message",
    [
        (
            dict(num_workers=0),
            "num_workers must be an int >= 1. Got num_workers=0",
        ),
        (
            dict(num_workers=2, worker_rank=2, servers=("a:1",)),
            r"worker_rank must be in \[0, num_workers=2\)",
        ),
        (dict(timeout=-1), "timeout must be a positive number"),
        (dict(servers=("nohost",)), "server address must be host:port"),
        (dict(servers=("a:1", "a:1"), num_workers=2), "lists an address twice"),
        (dict(num_workers=2), "needs summation servers"),
        (dict(partition_bytes="4"), 'partition_bytes must be an int.*"auto"'),
        (dict(job_id=""), "job_id must be a non-empty string"),
    ],
)
def test_invalid_settings_are_named(settings, message):
    with pytest.raises(errors.ConfigError, match=message):
        Config.from_env({}, **settings)


def test_bad_environment_value_names_the_variable():
    with pytest.raises(errors.ConfigError, match="JAXPS_NUM_WORKERS=.x."):
        Config.from_env({"JAXPS_NUM_WORKERS": "x"})


def test_reads_os_environ(monkeypatch):
    monkeypatch.setenv("JAXPS_NUM_WORKERS", "2")
    monkeypatch.setenv("JAXPS_SERVERS", "h:1")
    monkeypatch.setenv("JAXPS_TOKEN", "s3cr3t")
    cfg = Config.from_env()
    assert cfg.num_workers == 2 and cfg.token == "s3cr3t"
    assert "s3cr3t" not in repr(cfg)  # the token stays secret


def test_rank_and_size_fall_back_to_slurm():
    env = {"SLURM_PROCID": "2", "SLURM_NTASKS": "3", "JAXPS_SERVERS": "h:1"}
    cfg = Config.from_env(env)
    assert (cfg.worker_rank, cfg.num_workers) == (2, 3)
    env["JAXPS_WORKER_RANK"] = "0"  # JAXPS_* wins over the cluster's
    assert Config.from_env(env).worker_rank == 0
    with pytest.raises(errors.ConfigError, match="SLURM_NTASKS must be an"):
        Config.from_env({"SLURM_NTASKS": "many"})


@pytest.mark.parametrize(
    "env, rank, size",
    [
        # Open MPI's mpirun
        ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4"}, 1, 4),
        # MPICH's Hydra and other PMI launchers
        ({"PMI_RANK": "3", "PMI_SIZE": "4"}, 3, 4),
        # a Kubernetes Indexed Job: the size from the manifest's JAXPS_*
        ({"JOB_COMPLETION_INDEX": "2", "JAXPS_NUM_WORKERS": "3"}, 2, 3),
        # SLURM first, as srun may run inside an allocation started by MPI
        (
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "PMI_RANK": "1"},
            0,
            2,
        ),
    ],
)
def test_rank_and_size_from_mpi_and_kubernetes(env, rank, size):
    cfg = Config.from_env({**env, "JAXPS_SERVERS": "h:1"})
    assert (cfg.worker_rank, cfg.num_workers) == (rank, size)


def test_a_scheduler_rank_without_a_size_is_named():
    # an Indexed Job's pod knows its index, not the job's completions
    with pytest.raises(
        errors.ConfigError,
        match=r"worker_rank from JOB_COMPLETION_INDEX; num_workers not "
        r"set: set JAXPS_NUM_WORKERS",
    ):
        Config.from_env({"JOB_COMPLETION_INDEX": "2", "JAXPS_SERVERS": "h:1"})
    with pytest.raises(errors.ConfigError, match="PMI_SIZE must be an"):
        Config.from_env({"PMI_RANK": "0", "PMI_SIZE": "four"})


def test_unknown_setting():
    with pytest.raises(errors.ConfigError, match="unknown jaxps setting"):
        Config.from_env({}, num_servers=3)
