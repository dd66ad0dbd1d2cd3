"""Ray on vLLM-CPU (integration/ray_cpu): opt-in platform plugin, CPU binding rules, runtime env.

The end-to-end deployment test is tests/e2e/test_ray_cpu.py."""

import os

import pytest

from vllm_sparsever.integration import ray_cpu
from vllm_sparsever.integration.ray_cpu import binding
from vllm_sparsever.integration.ray_cpu.binding import CpuBinding, cpu_binding_for


def test_platform_plugin_is_inactive_unless_opted_in(monkeypatch):
    monkeypatch.delenv(ray_cpu.OPT_IN_ENV, raising=False)
    assert ray_cpu.platform_plugin() is None
    monkeypatch.setenv(ray_cpu.OPT_IN_ENV, "0")
    assert ray_cpu.platform_plugin() is None
    monkeypatch.setenv(ray_cpu.OPT_IN_ENV, "1")
    assert ray_cpu.platform_plugin() == ray_cpu.PLATFORM_QUALNAME


def test_platform_plugin_ignores_opt_in_on_other_builds(monkeypatch, caplog):
    from vllm_sparsever.compat import ray_executor

    monkeypatch.setenv(ray_cpu.OPT_IN_ENV, "1")
    monkeypatch.setattr(ray_executor, "builtin_cpu_platform_qualname", lambda: None)
    assert ray_cpu.platform_plugin() is None
    assert ray_cpu.OPT_IN_ENV in caplog.text

    def boom():
        raise RuntimeError("probe failed")

    monkeypatch.setattr(ray_executor, "builtin_cpu_platform_qualname", boom)
    assert ray_cpu.platform_plugin() is None  # vLLM would hide an exception; we log it


def test_platform_is_cpu_with_a_ray_resource():
    from vllm_sparsever.integration.ray_cpu.platform import SparseverRayCpuPlatform

    assert SparseverRayCpuPlatform().is_cpu()
    assert SparseverRayCpuPlatform.ray_device_key == ray_cpu.DEFAULT_RESOURCE


def test_entry_point_is_registered():
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="vllm.platform_plugins") if e.name == "sparsever_ray_cpu"]
    assert ep.load() is ray_cpu.platform_plugin


ONE_NUMA_2_CORES = [(0, 0, 0), (1, 1, 0)]
TWO_NUMA_8_CPUS = [(i, i % 4 + 4 * (i // 4), i // 4) for i in range(8)]  # no SMT
SMT_4_CPUS = [(0, 0, 0), (1, 1, 0), (2, 0, 0), (3, 1, 0)]  # cpus 2,3 are siblings of 0,1


@pytest.mark.parametrize(
    ("spec", "rank", "n", "driver", "allowed", "reserved", "want"),
    [
        # auto: the driver node keeps one core for the engine core unless every core is needed.
        ("auto", 0, 1, True, ONE_NUMA_2_CORES, None, (0,)),
        ("auto", 0, 1, False, ONE_NUMA_2_CORES, None, (0, 1)),
        ("auto", 1, 2, True, ONE_NUMA_2_CORES, None, (1,)),
        (None, 0, 1, True, ONE_NUMA_2_CORES, 0, (0, 1)),
        # auto: a NUMA node per worker when there are enough, one CPU per physical core.
        ("auto", 1, 2, False, TWO_NUMA_8_CPUS, None, (4, 5, 6, 7)),
        ("auto", 0, 1, False, SMT_4_CPUS, None, (0, 1)),
        # explicit lists, indexed by the rank on the node
        ("0|1", 1, 2, True, ONE_NUMA_2_CORES, None, (1,)),
        ("0-1", 0, 1, True, ONE_NUMA_2_CORES, None, (0, 1)),
    ],
)
def test_cpu_binding(spec, rank, n, driver, allowed, reserved, want):
    got = cpu_binding_for(spec, rank, n, driver, allowed, reserved)
    assert got == CpuBinding(want, len(want))


def test_nobind_keeps_the_users_thread_count():
    assert cpu_binding_for("nobind", 0, 1, False, ONE_NUMA_2_CORES, None, 7) == CpuBinding(None, 7)
    assert cpu_binding_for("nobind", 0, 2, False, ONE_NUMA_2_CORES) == CpuBinding(None, 1)


@pytest.mark.parametrize(
    ("spec", "n", "match"),
    [
        ("0|1", 1, "2 CPU list.*1 vLLM worker"),
        ("0-5", 1, r"CPUs \[2, 3, 4, 5\] are not available"),
        ("x", 1, "not a CPU list"),
        ("3-1", 1, "bad CPU range"),
    ],
)
def test_bad_bind_spec_names_the_variable(spec, n, match):
    with pytest.raises(ValueError, match=match) as err:
        cpu_binding_for(spec, 0, n, False, ONE_NUMA_2_CORES)
    assert binding.BIND_ENV in str(err.value)


def test_runtime_env_gets_hook_and_start_variables(monkeypatch):
    from vllm_sparsever.integration.ray_cpu.platform import with_worker_setup

    monkeypatch.setenv(ray_cpu.OPT_IN_ENV, "1")
    monkeypatch.setenv("LD_PRELOAD", "/lib/libx.so")
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    env = with_worker_setup({"env_vars": {"LD_PRELOAD": "/mine.so"}, "pip": ["x"]})
    assert env["worker_process_setup_hook"] == ray_cpu.WORKER_HOOK_QUALNAME
    assert env["env_vars"] == {"LD_PRELOAD": "/mine.so", ray_cpu.OPT_IN_ENV: "1"}  # user wins
    assert "pip" in env  # other fields kept
    assert with_worker_setup(None)["env_vars"][ray_cpu.OPT_IN_ENV] == "1"
    with pytest.raises(ValueError, match="worker_process_setup_hook"):
        with_worker_setup({"worker_process_setup_hook": "theirs.hook"})


def test_ray_parallel_config_refusals(monkeypatch):
    from types import SimpleNamespace

    from vllm_sparsever.integration.ray_cpu import platform
    from vllm_sparsever.integration.ray_cpu.platform import check_ray_parallel_config

    check_ray_parallel_config(SimpleNamespace(data_parallel_size=1))
    with pytest.raises(ValueError, match="data_parallel_size.*allowed: 1"):
        check_ray_parallel_config(SimpleNamespace(data_parallel_size=2))
    monkeypatch.setattr(platform, "uses_ray_v2_executor", lambda: False)
    with pytest.raises(ValueError, match="VLLM_USE_RAY_V2_EXECUTOR_BACKEND"):
        check_ray_parallel_config(SimpleNamespace(data_parallel_size=1))


def test_gloo_binds_to_the_interface_of_the_node_address_unless_the_node_names_one(monkeypatch):
    """Across hosts gloo must not bind where the host name resolves (often 127.0.x.1): the Ray
    worker sets GLOO_SOCKET_IFNAME to the interface that holds its node's Ray address."""
    import ray

    from vllm_sparsever.integration.ray_cpu import worker_hook

    assert worker_hook.interface_of("127.0.0.1") == "lo"
    assert worker_hook.interface_of("203.0.113.77") is None
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    monkeypatch.setattr(worker_hook, "_node_gloo_ifname", None)
    monkeypatch.setattr(worker_hook, "_node_host_ip", None)
    monkeypatch.setenv(worker_hook.GLOO_IFNAME_ENV, "eth-of-the-head")  # copied from the driver
    monkeypatch.delenv(worker_hook.HOST_IP_ENV, raising=False)
    worker_hook._set_node_addresses()
    assert os.environ[worker_hook.GLOO_IFNAME_ENV] == "lo"
    assert os.environ[worker_hook.HOST_IP_ENV] == "127.0.0.1"  # vLLM's address: the node's Ray address
    monkeypatch.setattr(worker_hook, "_node_host_ip", "10.0.0.9")
    worker_hook._set_node_addresses()
    assert os.environ[worker_hook.HOST_IP_ENV] == "10.0.0.9"
    monkeypatch.setattr(worker_hook, "_node_gloo_ifname", "bond0")  # the node's own choice wins
    worker_hook._set_node_addresses()
    assert os.environ[worker_hook.GLOO_IFNAME_ENV] == "bond0"
    monkeypatch.setattr(worker_hook, "_node_gloo_ifname", None)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "203.0.113.77")  # no interface holds it
    monkeypatch.setenv(worker_hook.GLOO_IFNAME_ENV, "kept")
    worker_hook._set_node_addresses()
    assert os.environ[worker_hook.GLOO_IFNAME_ENV] == "kept"
