"""The Jetson board kit (jetson/): shell scripts pass shellcheck, the systemd unit passes
`systemd-analyze verify` and yields a valid mdi-worker command line, mdi.system.tegra parses tegrastats
lines of TX2, Xavier, Nano and Orin boards, the probe replays a capture, and setup.sh refuses
an unpinned torch. None of it needs a Jetson."""
import glob
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys

import pytest

from conftest import BIN, ROOT, missing
from mdi.system import memory, tegra
from mdi.cli.worker import worker_parser

JETSON = os.path.join(ROOT, "jetson")
SETUP = os.path.join(JETSON, "setup.sh")
UNIT = os.path.join(JETSON, "mdi-worker.service")
ENV_EXAMPLE = os.path.join(JETSON, "mdi-worker.env.example")
PROBE = os.path.join(JETSON, "tegra_probe.py")

# Sample lines in the documented formats of each board family and JetPack generation.
TX2_IDLE = ("RAM 2040/7854MB (lfb 1027x4MB) SWAP 0/3927MB (cached 0MB) CPU [2%@345,off,off,1%@345,0%@345,0%@345] "
            "EMC_FREQ 0%@1866 GR3D_FREQ 0%@114 APE 150 PLL@39C MCPU@39C PMIC@100C Tboard@35C GPU@37C BCPU@39C "
            "thermal@38.6C Tdiode@36.25C VDD_SYS_GPU 152/152 VDD_SYS_SOC 458/458 VDD_4V0_WIFI 0/0 VDD_IN 2058/2058 "
            "VDD_SYS_CPU 152/152 VDD_SYS_DDR 115/115")
TX2_BUSY = ("RAM 6120/7854MB (lfb 12x4MB) SWAP 412/3927MB (cached 20MB) CPU [38%@2035,off,off,27%@2035,31%@2035,"
            "25%@2035] EMC_FREQ 41%@1866 GR3D_FREQ 99%@1300 APE 150 MTS fg 1% bg 2% PLL@46C MCPU@46C PMIC@100C "
            "Tboard@40C GPU@44.5C BCPU@46C thermal@45.3C Tdiode@42.75C VDD_SYS_GPU 4582/3890 VDD_SYS_SOC 1068/1050 "
            "VDD_4V0_WIFI 0/0 VDD_IN 9912/8874 VDD_SYS_CPU 1220/1188 VDD_SYS_DDR 1456/1390")
NANO_JP4 = ("RAM 1766/3964MB (lfb 197x4MB) SWAP 0/2048MB (cached 0MB) CPU [24%@1224,15%@1224,13%@1224,10%@1224] "
            "EMC_FREQ 0% GR3D_FREQ 0% PLL@21C CPU@25C PMIC@100C GPU@23.5C AO@33.5C thermal@24.5C "
            "POM_5V_IN 2545/2547 POM_5V_GPU 0/0 POM_5V_CPU 549/529")
AGX_XAVIER_JP4 = ("RAM 2547/15692MB (lfb 2893x4MB) SWAP 0/7846MB (cached 0MB) CPU [1%@1190,0%@1190,0%@1190,0%@1190,"
                  "off,off,off,off] EMC_FREQ 0%@2133 GR3D_FREQ 0%@1377 APE 150 MTS fg 0% bg 0% AO@29.5C GPU@29.5C "
                  "Tboard@30C Tdiode@31.75C AUX@29.5C CPU@30.5C thermal@29.85C PMIC@100C GPU 0/0 CPU 310/310 "
                  "SOC 1243/1243 CV 0/0 VDDRQ 155/155 SYS5V 1416/1416")
XAVIER_NX_JP5 = ("03-14-2023 10:02:11 RAM 2448/7764MB (lfb 18x4MB) SWAP 0/3882MB (cached 0MB) CPU [3%@1190,2%@1190,"
                 "1%@1190,1%@1190,off,off] EMC_FREQ 0%@1600 GR3D_FREQ 0%@[114] VIC_FREQ 115 APE 150 AUX@32C CPU@33C "
                 "thermal@32.45C AO@32C GPU@32.5C PMIC@50C VDD_IN 4044mW/4044mW VDD_CPU_GPU_CV 535mW/535mW "
                 "VDD_SOC 1226mW/1226mW")
AGX_ORIN_JP5 = ("08-29-2022 13:36:49 RAM 2472/30536MB (lfb 6781x4MB) SWAP 0/15268MB (cached 0MB) CPU [0%@729,0%@729,"
                "0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,off,off,off,off] EMC_FREQ 0%@2133 GR3D_FREQ 0%@[0,0] "
                "VIC_FREQ 729 APE 233 CV0@-256C CPU@45.062C SOC2@42.218C SOC0@43.375C CV1@-256C GPU@41.812C "
                "tj@45.062C SOC1@42.437C CV2@-256C VDD_GPU_SOC 2794mW/2794mW VDD_CPU_CV 397mW/397mW "
                "VIN_SYS_5V0 2622mW/2622mW VDDQ_VDD2_1V8AO 302mW/302mW")
ORIN_NANO_JP6 = ("11-22-2024 08:15:02 RAM 3162/7620MB (lfb 4x2MB) SWAP 0/3810MB (cached 0MB) CPU [1%@729,0%@729,"
                 "0%@729,0%@729,off,off] EMC_FREQ 0%@2133 GR3D_FREQ 61%@[305,305] NVDEC off NVJPG off NVJPG1 off "
                 "VIC off OFA off APE 200 cpu@62.843C soc2@61.968C soc0@60.625C gpu@61.687C tj@62.843C "
                 "soc1@61.687C VDD_IN 7913mW/6922mW VDD_CPU_GPU_CV 2598mW/1598mW VDD_SOC 1238mW/1237mW")


# --- shellcheck -------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def shellcheck():
    """shellcheck (Debian package; scripts/test.sh installs it): skips without it, fails in CI."""
    found = shutil.which("shellcheck")
    if not found:
        missing("shellcheck", "apt-get install shellcheck")
    return found


def test_shell_scripts_pass_shellcheck(shellcheck):
    scripts = sorted(glob.glob(os.path.join(JETSON, "*.sh")))
    py38_job = os.path.join(ROOT, ".ci", "py38")
    if os.path.exists(py38_job):
        scripts.append(py38_job)
    assert SETUP in scripts
    proc = subprocess.run([shellcheck, "--shell=bash", "--severity=style"] + scripts,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True)
    assert proc.returncode == 0, proc.stdout
    for script in scripts:
        assert os.stat(script).st_mode & stat.S_IXUSR, "%s is not executable" % script


# --- the systemd unit ------------------------------------------------------------------------

def unit_env():
    """The unit's Environment= defaults overridden by the example environment file, as systemd does."""
    env = {}
    for line in open(UNIT, encoding="utf-8"):
        if line.startswith("Environment="):
            for pair in line[len("Environment="):].split():
                key, _, value = pair.partition("=")
                env[key] = value
    for line in open(ENV_EXAMPLE, encoding="utf-8"):
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = value
    return env


def unit_command(env):
    """ExecStart expanded like systemd: ${VAR} in place, a bare $VAR word split into words."""
    line = next(l for l in open(UNIT, encoding="utf-8") if l.startswith("ExecStart="))
    words = []
    for word in line[len("ExecStart="):].split():
        if re.fullmatch(r"\$\w+", word):
            words += env[word[1:]].split()
        else:
            words.append(re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], word))
    return words


def test_unit_passes_systemd_analyze_verify(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if not analyze:
        pytest.skip("systemd-analyze not found (Debian package systemd)")
    # verify checks that ExecStart's binary exists: point it at this environment's mdi-worker,
    # as setup.sh points it at the board's venv.
    worker = os.path.join(BIN, "mdi-worker")
    if not os.access(worker, os.X_OK):
        worker = shutil.which("true")
    text = open(UNIT, encoding="utf-8").read()
    assert "/opt/mdi/venv/bin/mdi-worker" in text
    unit = tmp_path / "mdi-worker.service"
    unit.write_text(text.replace("/opt/mdi/venv/bin/mdi-worker", worker))
    proc = subprocess.run([analyze, "verify", str(unit)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          universal_newlines=True, timeout=120)
    # verify exits 0 on warnings such as unknown keys: any line about our unit is a failure.
    ours = [l for l in proc.stdout.splitlines() if "mdi-worker" in l]
    assert proc.returncode == 0 and not ours, proc.stdout


def test_unit_settings_and_command_line():
    text = open(UNIT, encoding="utf-8").read()
    for needle in ("EnvironmentFile=/etc/mdi/mdi-worker.env", "Restart=on-failure", "User=mdi",
                   "--port ${MDI_PORT}", "After=network-online.target", "WantedBy=multi-user.target"):
        assert needle in text
    env = unit_env()
    assert env["MDI_TOKEN_FILE"] == "/etc/mdi/token" and env["MDI_PORT"] == "8081"
    argv = unit_command(env)
    args = worker_parser().parse_args(argv[1:])  # the flags really are mdi-worker's
    assert (args.port, args.host, args.threads) == (8081, "0.0.0.0", 4)
    assert args.models_dir == "/var/lib/mdi"  # where step 6 puts the chunk files (ring3.example.yaml)
    assert args.token_file is None  # the secret's path comes from $MDI_TOKEN_FILE, never argv
    extra = unit_command(dict(env, MDI_WORKER_ARGS="--max-memory 6 --device cuda"))
    assert worker_parser().parse_args(extra[1:]).max_memory == 6.0


# --- mdi.system.tegra -------------------------------------------------------------------------------

def test_parse_tx2():
    r = tegra.parse_tegrastats(TX2_IDLE)
    assert (r["ram_used_mb"], r["ram_total_mb"], r["swap_used_mb"], r["swap_total_mb"]) == (2040, 7854, 0, 3927)
    assert r["cpu_load"] == [2, None, None, 1, 0, 0]  # the two Denver cores are off
    assert r["cpu_freq_mhz"][0] == 345
    assert (r["gpu_load"], r["gpu_freq_mhz"], r["emc_load"]) == (0, 114, 0)
    assert r["temp_c"]["GPU"] == 37.0 and r["temp_c"]["thermal"] == 38.6
    assert r["power_mw"]["VDD_SYS_GPU"] == 152 and r["power_mw"]["VDD_SYS_DDR"] == 115
    assert (r["input_power_rail"], r["input_power_mw"]) == ("VDD_IN", 2058)
    assert "time" not in r

    busy = tegra.parse_tegrastats(TX2_BUSY)
    assert (busy["gpu_load"], busy["gpu_freq_mhz"], busy["swap_cached_mb"]) == (99, 1300, 20)
    assert busy["power_mw"]["VDD_IN"] == 9912 and busy["power_avg_mw"]["VDD_IN"] == 8874


def test_parse_nano_and_xavier():
    nano = tegra.parse_tegrastats(NANO_JP4)
    assert (nano["input_power_rail"], nano["input_power_mw"]) == ("POM_5V_IN", 2545)
    assert nano["gpu_load"] == 0 and "gpu_freq_mhz" not in nano

    agx = tegra.parse_tegrastats(AGX_XAVIER_JP4)
    assert agx["power_mw"] == {"GPU": 0, "CPU": 310, "SOC": 1243, "CV": 0, "VDDRQ": 155, "SYS5V": 1416}
    assert (agx["input_power_rail"], agx["input_power_mw"]) == ("sum", 3124)  # no input monitor
    assert agx["temp_c"]["GPU"] == 29.5 and agx["cpu_load"][4:] == [None] * 4

    nx = tegra.parse_tegrastats(XAVIER_NX_JP5)
    assert nx["time"] == "03-14-2023 10:02:11"
    assert (nx["ram_used_mb"], nx["gpu_freq_mhz"]) == (2448, 114)
    assert nx["power_mw"] == {"VDD_IN": 4044, "VDD_CPU_GPU_CV": 535, "VDD_SOC": 1226}
    assert nx["input_power_mw"] == 4044


def test_parse_orin():
    agx = tegra.parse_tegrastats(AGX_ORIN_JP5)
    assert (agx["ram_used_mb"], agx["ram_total_mb"]) == (2472, 30536)
    assert len(agx["cpu_load"]) == 12 and agx["cpu_load"][-1] is None
    assert (agx["gpu_load"], agx["gpu_freq_mhz"]) == (0, 0)
    assert "CV0" not in agx["temp_c"] and agx["temp_c"]["tj"] == 45.062  # -256C: sensor off
    assert (agx["input_power_rail"], agx["input_power_mw"]) == ("sum", 2794 + 397 + 2622 + 302)

    nano = tegra.parse_tegrastats(ORIN_NANO_JP6)
    assert (nano["gpu_load"], nano["gpu_freq_mhz"]) == (61, 305)
    assert nano["temp_c"]["gpu"] == 61.687
    assert nano["power_mw"]["VDD_CPU_GPU_CV"] == 2598 and nano["power_avg_mw"]["VDD_IN"] == 6922
    assert (nano["input_power_rail"], nano["input_power_mw"]) == ("VDD_IN", 7913)
    assert set(nano) >= {"time", "swap_used_mb", "emc_load", "cpu_freq_mhz"}


def test_parse_rejects_other_lines():
    for line in ("", "tegrastats: error: permission denied", "VDD_IN 4044mW/4044mW"):
        with pytest.raises(ValueError):
            tegra.parse_tegrastats(line)
    ram_kb = tegra.parse_tegrastats("RAM 512/1024kB SWAP 1/2GB (cached 0MB)")
    assert (ram_kb["ram_total_mb"], ram_kb["swap_total_mb"]) == (1, 2048)


def test_l4t_version_and_detection(tmp_path):
    cases = {"# R32 (release), REVISION: 7.1, GCID: 29818004, BOARD: t186ref, EABI: aarch64, DATE: Sat Feb 19": "32.7.1",
             "# R35 (release), REVISION: 4.1, GCID: 33958178, BOARD: t186ref, EABI: aarch64, DATE: Tue Aug 1": "35.4.1",
             "# R36 (release), REVISION: 4.0, GCID: 37537400, BOARD: generic, EABI: aarch64, DATE: Fri Sep 13": "36.4.0"}
    for text, version in cases.items():
        path = tmp_path / "nv_tegra_release"
        path.write_text(text + "\n")
        assert tegra.l4t_version(str(path)) == version
        assert tegra.is_jetson(str(path))


def test_memory_helpers(tmp_path):
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:        7858228 kB\nMemAvailable:    3012340 kB\nNvMapMemUsed:     805068 kB\n"
                    "HugePages_Total:       0\n")
    m = memory.meminfo(str(info))
    assert m["MemTotal"] == 7858228 * 1024 and m["NvMapMemUsed"] == 805068 * 1024 and m["HugePages_Total"] == 0
    assert memory.meminfo(str(tmp_path / "missing")) == {}
    # Asking never initialises CUDA; where nothing in this process used it, the RSS is all.
    import torch
    was_initialized = torch.cuda.is_initialized()  # another test in this process may have used a GPU
    reserved = memory.cuda_reserved_bytes()
    assert torch.cuda.is_initialized() == was_initialized
    assert reserved == 0 or was_initialized
    # Read in an order that no thread allocating meanwhile can break (it failed so under load):
    # the RSS first, then the sums that hold it; the peak only grows, the current RSS may move.
    rss = memory.rss_bytes()
    assert rss > 0
    assert memory.unified_memory_bytes(peak=True) >= rss
    assert memory.unified_memory_bytes() >= memory.rss_bytes() - (64 << 20)
    report = memory.memory_report()
    assert report["used_bytes"] == report["total_bytes"] - report["available_bytes"]


@pytest.mark.parametrize("module", ["tegra.py", "memory.py"])
def test_system_probe_modules_are_stdlib_only(module):
    # Importable by the probe on a board without torch: no third-party import at module level.
    code = open(os.path.join(ROOT, "mdi", "system", module), encoding="utf-8").read()
    imports = re.findall(r"^(?:import|from) (\w+)", code, re.M)
    assert set(imports) <= {"hashlib", "os", "re", "resource", "shutil", "subprocess", "sys", "threading", "time",
                            "typing"}, \
        imports


# --- the probe -------------------------------------------------------------------------------

def run_probe(*args, timeout=60):
    return subprocess.run([sys.executable, PROBE] + list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, timeout=timeout)


def test_probe_replays_a_capture(tmp_path):
    log = tmp_path / "tegrastats.log"
    log.write_text("\n".join([TX2_IDLE, TX2_BUSY, "", "garbage line", TX2_IDLE]) + "\n")
    proc = run_probe("--file", str(log), "--out", str(tmp_path / "out.jsonl"))
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(l) for l in proc.stdout.splitlines()]
    assert [r["input_power_mw"] for r in records] == [2058, 9912, 2058]
    assert "skipped" in proc.stderr  # the garbage line is reported, not fatal
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 3

    once = run_probe("--file", str(log), "--once")
    assert once.returncode == 0 and len(once.stdout.splitlines()) == 1

    summary = json.loads(run_probe("--file", str(log), "--summary").stdout)
    assert summary == {"samples": 3, "ram_used_mb_max": 6120, "swap_used_mb_max": 412,
                       "input_power_mw_mean": round((2058 * 2 + 9912) / 3, 1), "input_power_mw_max": 9912}

    empty = tmp_path / "empty.log"
    empty.write_text("\n")
    assert run_probe("--file", str(empty)).returncode == 1
    assert run_probe("--file", str(tmp_path / "missing.log")).returncode == 2


def test_probe_runs_tegrastats_and_stops_it(tmp_path):
    # A stand-in tegrastats that prints forever: --once must take one line and end it.
    fake = tmp_path / "tegrastats"
    fake.write_text("#!/bin/sh\n[ \"$1\" = --interval ] || exit 3\nwhile :; do echo '%s'; sleep 0.05; done\n"
                    % ORIN_NANO_JP6)
    fake.chmod(0o755)
    proc = run_probe("--once", "--interval", "50", "--tegrastats", str(fake), timeout=30)
    assert proc.returncode == 0, proc.stderr
    (rec,) = [json.loads(l) for l in proc.stdout.splitlines()]
    assert rec["input_power_mw"] == 7913 and rec["t"] > 0
    missing = run_probe("--once", "--tegrastats", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "--file" in missing.stderr


# --- setup.sh --------------------------------------------------------------------------------

def setup(*args, release=None, tmp_path=None):
    env = dict(os.environ, MDI_TEGRA_RELEASE=str(release) if release else "/nonexistent/nv_tegra_release")
    return subprocess.run(["bash", SETUP] + list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, env=env, timeout=60)


def release_file(tmp_path, major, revision):
    path = tmp_path / ("R%s" % major)
    path.write_text("# R%s (release), REVISION: %s, GCID: 1, BOARD: t186ref, EABI: aarch64, DATE: x\n"
                    % (major, revision))
    return path


def test_setup_help():
    proc = setup("--help")
    assert proc.returncode == 0
    for flag in ("--torch-wheel", "--torch-index", "--torch-version", "--venv", "--dry-run", "--service"):
        assert flag in proc.stdout


@pytest.mark.parametrize("args, message", [
    ([], "refusing to install an unpinned torch"),
    (["--torch-index", "https://example.invalid/simple"], "refusing to install an unpinned torch"),
    (["--torch-version", ">=2.0"], "unpinned"),
    (["--torch-version", "2.*"], "unpinned"),
    (["--torch-wheel", "torch-1.10.0-cp36-cp36m-linux_aarch64.whl"], "needs torch >= 2.0"),
    (["--torch-wheel", "numpy-1.24.4-cp38-cp38-linux_aarch64.whl"], "must be a torch wheel"),
    (["--torch-wheel", "torch-2.1.0-cp38-cp38-linux_aarch64.whl", "--torch-version", "2.1.0"], "not both"),
])
def test_setup_refuses_unpinned_or_wrong_torch(tmp_path, args, message):
    proc = setup("--dry-run", *args, release=release_file(tmp_path, 35, "4.1"))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "+ " not in proc.stdout  # refused before doing anything


def test_setup_checks_wheel_matches_python(tmp_path):
    proc = setup("--dry-run", "--python", sys.executable,
                 "--torch-wheel", "torch-2.1.0a0+41361538.nv23.06-cp36-cp36-linux_aarch64.whl",
                 release=release_file(tmp_path, 35, "4.1"))
    assert proc.returncode == 2 and "is for cp36" in proc.stderr


def test_setup_refuses_a_non_jetson_without_dry_run():
    if tegra.l4t_version():
        pytest.skip("this is a Jetson")
    proc = setup("--torch-version", "2.1.2")
    assert proc.returncode == 2 and "does not look like a Jetson" in proc.stderr


@pytest.mark.parametrize("major, revision, needles", [
    (32, "7.1", ["JetPack 4.x", "CUDA 10.2", "python3.8"]),
    (35, "3.1", ["JetPack 5.1 / 5.1.1", "v511/pytorch/torch-2.0.0+nv23.05-cp38"]),
    (35, "4.1", ["JetPack 5.1.2", "v512/pytorch/torch-2.1.0a0+41361538.nv23.06-cp38"]),
    (36, "3.0", ["JetPack 6.0", "v60/pytorch/"]),
    (36, "4.0", ["JetPack 6.1 / 6.2", "v61/pytorch/torch-2.5.0a0"]),
])
def test_setup_detects_jetpack_and_matching_torch(tmp_path, major, revision, needles):
    proc = setup("--detect", release=release_file(tmp_path, major, revision))
    assert proc.returncode == 0, proc.stderr
    assert "L4T %d.%s" % (major, revision) in proc.stdout
    for needle in needles:
        assert needle in proc.stdout


def test_setup_dry_run_installs_torch_once_then_mdi_without_deps(tmp_path):
    wheel = ("https://developer.download.nvidia.com/compute/redist/jp/v512/pytorch/"
             "torch-2.1.0a0+41361538.nv23.06-cp38-cp38-linux_aarch64.whl")
    venv = str(tmp_path / "venv")
    # A python3.8 as on JetPack 5 (setup.sh checks the wheel's cp38 against it).
    python38 = tmp_path / "python3.8"
    python38.write_text('#!/bin/sh\ncase "$2" in *version_info*) echo 3.8; exit 0;; esac\nexec %s "$@"\n'
                        % sys.executable)
    python38.chmod(0o755)
    args = ("--dry-run", "--torch-wheel", wheel, "--venv", venv, "--python", str(python38), "--service")
    # a service without its secret is refused before any step, a dry run too (it was refused last)
    for token in [("--token-file", str(tmp_path / "missing"))] + ([()] if not os.path.exists("/etc/mdi/token") else []):
        proc = setup(*(args + token), release=release_file(tmp_path, 35, "4.1"))
        assert proc.returncode != 0 and "+ " not in proc.stdout, proc.stdout
        assert "shared secret" in proc.stderr or "missing or empty" in proc.stderr, proc.stderr
    secret = tmp_path / "token"
    secret.write_text("s" * 32)
    proc = setup(*(args + ("--token-file", str(secret))), release=release_file(tmp_path, 35, "4.1"))
    assert proc.returncode == 0, proc.stderr
    # Each step is printed shell-quoted after "+ "; "(...)" lines describe a step in words.
    steps = [shlex.split(l[2:]) for l in proc.stdout.splitlines() if l.startswith("+ ") and l[2] != "("]
    py = "%s/bin/python" % venv
    pip = [s[4:] for s in steps if s[:4] == [py, "-m", "pip", "install"]]
    assert [s for s in pip if any("torch" in w for w in s) and "-c" not in s] == [[wheel]]  # torch: once
    deps = next(s for s in pip if "flask" in s)
    assert deps[:2] == ["-c", "%s/torch-constraint.txt" % venv]  # torch stays exactly as installed
    assert "numpy<2" in deps and not any(w.startswith("torch") for w in deps)
    assert pip[-1] == ["--no-deps", ROOT]  # mdi last, without letting pip resolve torch again
    assert ["systemctl", "enable", "mdi-worker"] in steps
    assert any("/etc/systemd/system/mdi-worker.service" in " ".join(s) for s in steps)


def test_setup_dry_run_from_an_index_pins_the_version(tmp_path):
    proc = setup("--dry-run", "--torch-index", "https://example.invalid/jp6/cu126", "--torch-version", "2.5.0",
                 "--venv", str(tmp_path / "v"), release=release_file(tmp_path, 36, "4.0"))
    assert proc.returncode == 0, proc.stderr
    assert "--no-deps --index-url https://example.invalid/jp6/cu126 torch==2.5.0" in proc.stdout


def test_worked_example_config():
    from mdi.runconfig import load_config
    from mdi.runconfig.nodes import partition
    path = os.path.join(JETSON, "ring3.example.yaml")
    cfg = load_config(path)
    assert [n.name for n in cfg.nodes] == ["jetson1", "jetson2", "jetson3"]
    assert partition(30, cfg.nodes, path) == [10, 10, 10]  # SmolLM2-135M cut 10-10-10
    assert [n.weights for n in cfg.workers] == ["/var/lib/mdi/smollm2-135m-10-10-10/node%d.safetensors" % k
                                                for k in (1, 2)]
    models_dir = unit_env()["MDI_MODELS_DIR"]  # the service reads weights only under it
    assert all(n.weights.startswith(models_dir + "/") for n in cfg.workers)
    assert [n.port for n in cfg.workers] == [8081, 8081] and cfg.runtime.token_file is None
    readme = open(os.path.join(JETSON, "README.md"), encoding="utf-8").read()
    nodes = open(path, encoding="utf-8").read().split("nodes:", 1)[1].split("\n#", 1)[0]
    for line in nodes.splitlines()[1:]:  # the README shows the same nodes
        assert line.split("#")[0].strip() in readme, line
    assert "mdi-prepare smollm2-135m --out models/smollm2-135m --chunks 10-10-10" in readme
    assert "mdi-start --check --config ~/ring3.yaml" in readme
