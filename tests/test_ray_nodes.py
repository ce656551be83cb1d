"""jaxps on a Ray cluster of several simulated nodes
(`ray.cluster_utils.Cluster`): a CPU machine with a custom resource and two
GPU machines (declared GPUs). The servers land on the CPU machine, one
worker on each GPU machine, each with its GPU."""

import numpy as np
import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from jaxps._src.launch import ray as launch_ray  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _where():
    import ray

    import jaxps

    jaxps.init()
    total = jaxps.push_pull_numpy(
        "w", np.full(8, jaxps.rank() + 1.0, np.float32), average=False
    )
    context = ray.get_runtime_context()
    return context.get_node_id(), ray.get_gpu_ids(), float(total[0])


def _node_of(actor):
    return ray.get(
        actor.__ray_call__.remote(
            lambda a: ray.get_runtime_context().get_node_id()
        )
    )


def test_servers_on_cpu_nodes_and_workers_on_gpu_nodes():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        cpu = cluster.add_node(num_cpus=2, resources={"cpu_node": 1})
        gpus = [cluster.add_node(num_cpus=1, num_gpus=1) for _ in range(2)]
        ray.init(address=cluster.address)
        cluster.wait_for_nodes()
        settings = launch_ray.RaySettings(
            num_workers=2,
            num_servers=2,
            gpus_per_worker=1,
            server_resources={"cpu_node": 0.01},
            placement="SPREAD",
            server_host="127.0.0.1",  # every simulated node is this machine
        )
        job = launch_ray._Job(settings, cluster.address)
        try:
            job.start_workers(job.start_servers())
            refs = [w.run.remote(_where, (), {}) for w in job.workers]
            results = job.results(refs, 120)
            servers = {_node_of(a) for a in job.servers}
        finally:
            job.close()
    finally:
        ray.shutdown()
        cluster.shutdown()
    assert servers == {cpu.node_id}
    assert {node for node, _, _ in results} == {g.node_id for g in gpus}
    for _, gpu_ids, total in results:
        assert len(gpu_ids) == 1 and total == 3.0
