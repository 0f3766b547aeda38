"""runtime.kernel_memory: what quantized kernels may hold beyond the stored weights. 0 by
default (a node holds its stored weights, KV cache and prefix cache, and no kernel copies);
a size or `auto` opts in to the faster kernels that hold more, and `mdi-start --check` shows
the setting and what it admits on each node."""
import re

import pytest

from ringconfigs import write_run_config
from mdi.cli.start import start_main
from mdi.ring.init_request import RequestError, prefix_cache_field
from mdi.runconfig import ConfigError, RuntimeSpec, load_config, parse_kernel_memory

pytestmark = pytest.mark.usefixtures("module_on_torch")  # runtime.kernel_memory is torch's kernels' allowance


def test_the_default_is_none():
    assert RuntimeSpec().kernel_memory == 0


@pytest.mark.parametrize("raw,expected", [(0, 0), (False, 0), ("off", 0), ("auto", "auto"), ("64MB", 64 << 20),
                                          (1000, 1000), ("1.5G", int(1.5 * (1 << 30)))])
def test_settings_read(raw, expected):
    assert parse_kernel_memory("runtime.kernel_memory", raw) == expected


def test_a_bad_setting_is_one_line():
    with pytest.raises(ConfigError, match="runtime.kernel_memory: expected off, auto or a size"):
        parse_kernel_memory("runtime.kernel_memory", "lots")


def test_a_config_file_sets_it(tiny_models, tmp_path):
    path = write_run_config(tmp_path / "run.yaml", tiny_models["llama"], runtime={"kernel_memory": "32MB"})
    assert load_config(path).runtime.kernel_memory == 32 << 20


def test_init_requests_carry_it_checked():
    assert prefix_cache_field(None, "kernel_memory") is None and prefix_cache_field("auto", "kernel_memory") == "auto"
    with pytest.raises(RequestError, match="kernel_memory must be"):
        prefix_cache_field(-1, "kernel_memory")


@pytest.mark.parametrize("flag,line,node", [
    ([], "kernel memory: 0 (runtime.kernel_memory): each node holds its stored weights", "kernel copies 0 MB"),
    (["--kernel-memory", "1MB"], "kernel memory: 1.0 MB per node (runtime.kernel_memory)", "kernel copies up to 1.0 MB"),
    (["--kernel-memory", "auto"], "kernel memory: auto (runtime.kernel_memory)", "kernel copies up to ")])
def test_check_shows_the_allowance_and_what_it_admits(tiny_models, tmp_path, capsys, flag, line, node):
    path = write_run_config(tmp_path / "run.yaml", tiny_models["llama"])
    assert start_main(["--config", path, "--quant", "int4", "--check"] + flag) == 0
    out = capsys.readouterr().out
    assert line in out, out
    starter = next(l for l in out.splitlines() if "(this machine)" in l)
    assert node in starter, starter
    if flag[-1:] == ["auto"]:  # all the starter's memory spares: more than a MB on any test machine
        assert float(re.search(r"kernel copies up to ([0-9.]+) MB", starter).group(1)) > 1
