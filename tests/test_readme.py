"""The documentation: README.md and the user guide in docs/. Every command in a ```bash block of those pages is run as
written by a test here, or listed in NOT_RUN with the reason it cannot run on a CPU machine, and then at least
parsed (`bash -n`, the CLI's subcommands and options, the config files and variables it names). Every relative link
leads to a file (and heading) that exists, and so does every file path the pages name. The `accelerate launch`
lines run with the shipped configs in test_user_path.py, the install lines in test_packaging.py. Blocks that are
not meant to run here (output, GPU jobs, third-party scripts) are fenced as `text`."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

import accel_ds_fix
from accel_ds_fix.memory import tiers
from accel_ds_fix.ops import libaio
from conftest import ROOT, clean_env, nvme_unavailable, run

README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
# The measurement record: it quotes third-party paths and machine-specific commands, and keeps its older lines as
# they were measured; the user pages (README and the guide) are held to the stricter checks.
RECORD = {ROOT / "docs" / "gpu.md", ROOT / "docs" / "validation.md"}
GUIDE = [p for p in PAGES if p != README and p not in RECORD]
BIN = Path(sys.executable).parent
FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```", re.S | re.M)


def blocks(page, language="bash"):
    """The bodies of the page's fenced blocks of ``language`` (indented ones, inside list items, too)."""
    return [textwrap.dedent(body) for _, lang, body in FENCE.findall(page.read_text()) if lang == language]


def block_commands(body):
    """A block's commands as typed: comment lines dropped, `\\` continuations joined, a trailing `  # ...` cut."""
    lines = body.replace("\\\n", " ").splitlines()
    return [re.sub(r"\s+", " ", line.split("  #")[0]).strip() for line in lines
            if line.strip() and not line.lstrip().startswith("#")]


def documented():
    """(page, command) for every command of every page, README first."""
    return [(page, c) for page in PAGES for body in blocks(page) for c in block_commands(body)]


def commands():
    return [c for _, c in documented()]


# What happens to each documented command: the first pattern that matches it (re.match) says so. A test name: that
# test runs every command so matched, as written. Anything else: why it is not run here.
DEMO = "test_demo_fails_without_the_fix_and_trains_with_it"
CLASSIFIED = [
    (r"\./scripts/demo\.sh$", DEMO),
    (r"ACCEL_DS_FIX=1 python examples/train_two_models\.py ", DEMO),  # the demo's second run: checked below
    (r"python -m accel_ds_fix$", "test_plan_commands_run_as_written"),
    (r"python -m accel_ds_fix build-ops$", "test_build_ops_command_leaves_every_op_built_or_says_why"),
    (r"python -m accel_ds_fix plan --model ", "needs a model folder of the user's (`plan --model` is tested on a "
                                              "folder of the test's own in test_memory.py)"),
    (r"python -m accel_ds_fix plan .*--nvme-path ", "test_nvme_commands_run_as_written"),
    (r"mkdir -p /var/tmp/accel_ds_fix_nvme$", "test_nvme_commands_run_as_written"),
    (r"python -m accel_ds_fix clean-swap ", "test_nvme_commands_run_as_written"),
    (r"python -m accel_ds_fix plan ", "test_every_plan_command_runs_as_written"),
    (r"python -m accel_ds_fix get-libaio$", "test_nvme_commands_run_as_written"),
    (r"python -m accel_ds_fix convert-checkpoint ", "needs a checkpoint a training saved (test_resume_across_layouts.py "
                                                    "runs the command on one)"),
    (r"pip wheel ", "test_wheel_command_builds_the_file_the_readme_installs"),
    (r"pip install \.$", "installs into the reader's environment (test_packaging.py installs the checkout into a "
                         "fresh venv, as a wheel and editable)"),
    (r"\./scripts/test\.sh$", "the whole suite, this test among it: .ci/run calls it (checked below)"),
    (r"\./scripts/test\.sh --quick$", "the suite's tests marked quick, this one among them (pytest -m quick)"),
    (r"sudo ", "needs root and changes the system's packages"),
    (r"ulimit -l$", "test_harmless_shell_commands_run_as_written"),
    (r"([A-Z_]+=\S+ )*accelerate launch --config_file \S+ \S+\.py ", "a training script of the user's (`...`: its "
                                                                      "arguments); test_user_path.py launches every "
                                                                      "shipped config with examples/"
                                                                      "train_two_models.py"),
]


def classification(command):
    return next((what for pattern, what in CLASSIFIED if re.match(pattern, command)), None)


def run_by(test_name):
    """The documented commands (distinct, in page order) that ``test_name`` runs as written."""
    return list(dict.fromkeys(c for c in commands() if classification(c) == test_name))


def shell(command, home, check=True):
    """Run a documented command as a reader types it: bash, from the checkout, this venv's python, pip and accelerate
    first on PATH, and ``home`` as HOME (so `~/...` is written there, not into the real home)."""
    env = clean_env(HOME=str(home), PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    return run(["bash", "-c", command], env=env, check=check)


@pytest.mark.quick
def test_every_documented_command_is_run_or_classified():
    assert commands(), "no ```bash blocks found"
    unknown = [f"{page.relative_to(ROOT)}: {c}" for page, c in documented() if classification(c) is None]
    assert not unknown, "add each to CLASSIFIED (run it in a test, or say why it cannot run here):\n" + "\n".join(unknown)
    for _, what in CLASSIFIED:
        if what.startswith("test_"):
            assert callable(globals().get(what)), f"{what} is not a test of this module"


def test_commands_not_run_here_at_least_parse(tmp_path):
    subcommands = run([BIN / "python", "-m", "accel_ds_fix", "--help"]).stdout
    variables = "\n".join(p.read_text() for p in (ROOT / "accel_ds_fix").rglob("*.py"))
    for page, command in documented():
        if classification(command).startswith("test_"):
            continue
        where = f"{page.relative_to(ROOT)}: {command}"
        assert subprocess.run(["bash", "-n", "-c", command]).returncode == 0, where
        for name in re.findall(r"\b(ACCEL_DS_FIX\w*)=", command):
            assert name == "ACCEL_DS_FIX" or f'"{name}"' in variables, f"{where}: the package reads no {name}"
        cli = re.match(r"python -m accel_ds_fix (\S+)(.*)", command)
        if cli:
            sub, rest = cli.groups()
            assert re.search(rf"^    {re.escape(sub)}\b", subcommands, re.M), f"{where}: no subcommand {sub}"
            options = run([BIN / "python", "-m", "accel_ds_fix", sub, "--help"]).stdout
            for option in re.findall(r"(--[\w-]+)", rest):
                assert option in options, f"{where}: {sub} has no {option}"
        launch = re.search(r"accelerate launch --config_file (\S+)", command)
        if launch:
            config = launch.group(1)
            if config.startswith("~/"):  # written by a documented `plan --write`, with a shipped tier's file name
                folder = config.rsplit("/", 1)[0]
                assert any(re.search(rf"--write {re.escape(folder)}\b", c) for c in commands()), where
                assert (ROOT / "configs" / Path(config).name).exists(), where
            else:
                assert (ROOT / config).exists(), where
    # The demo's second run is the command the docs show, and .ci/run calls the documented test command.
    demo = (ROOT / "scripts" / "demo.sh").read_text()
    shown = next(c for c in commands() if c.startswith("ACCEL_DS_FIX=1 python examples/train_two_models.py "))
    assert f"ARGS=({shown.split(' ', 2)[2]})" in demo and 'ACCEL_DS_FIX=1 python "${ARGS[@]}"' in demo
    assert (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1] == "./scripts/test.sh"


def test_plan_commands_run_as_written(tmp_path):
    # The README's 6 GB recipe: the plan recommends the NVMe tier and writes the config the next line launches.
    plan = next(c for c in commands() if c.startswith("python -m accel_ds_fix plan --params 983M --gpu-memory 6GiB "
                                                      "--host-memory 15GiB --write "))
    proc = shell(plan, tmp_path, check=False)
    if nvme_unavailable():  # the plan says why instead, and recommends nothing it cannot run
        assert "zero3-nvme: cannot run here: " in proc.stdout and "no tier fits and runs here" in proc.stdout
        assert proc.returncode == 1 and "nothing written" in proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr
        assert "recommended: zero3-nvme" in proc.stdout
        launch = next(c for c in run_by_launch() if "~/" in c)
        written = tmp_path / launch.split("--config_file ~/")[1].split()[0]
        assert written.exists() and str(written) in proc.stdout
    report = next(c for c in commands() if c == "python -m accel_ds_fix")
    assert "fix active:" in run([BIN / "python", *report.split()[1:]], env=clean_env()).stdout


def run_by_launch():
    return [c for c in commands() if "accelerate launch --config_file" in c]


def test_every_plan_command_runs_as_written(tmp_path):
    # Each distinct plan command of the pages (the 6 GB recipe's runs in the test above as well: 4 s each).
    plans = run_by("test_every_plan_command_runs_as_written")
    assert len(plans) >= 3, plans
    for plan in plans:
        proc = shell(plan, tmp_path, check=False)
        if "--write" in plan and nvme_unavailable() and proc.returncode == 1:
            assert "nothing written" in proc.stderr, plan
            continue
        assert proc.returncode == 0, f"{plan}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        if "--json" in plan:
            assert {"tiers", "recommended"} <= set(json.loads(proc.stdout)), plan
        else:
            assert re.search(r"^(recommended: \S+|no tier fits and runs here)", proc.stdout, re.M), plan
        if "--trainable 2.2M" in plan:  # the LoRA recipe: the fastest tier fits
            assert "recommended: zero2-offload" in proc.stdout


def test_build_ops_command_leaves_every_op_built_or_says_why():
    # scripts/test.sh ran it before the suite: here every op is found built (or cannot be built, with the reason),
    # and the report then says cpu_adam is built.
    build = next(c for c in commands() if c == "python -m accel_ds_fix build-ops")
    out = run([BIN / "python", *build.split()[1:]], env=clean_env()).stdout
    for op in ("cpu_adam", "async_io", "deepspeed_shm_comm"):
        line = next(line for line in out.splitlines() if line.startswith(f"{op}: "))
        assert re.match(rf"{op}: (already built|built in \d+ s|cannot be built here: \S)", line), line
    assert "DeepSpeed cpu_adam op: built" in run([BIN / "python", "-m", "accel_ds_fix"], env=clean_env()).stdout


def test_wheel_command_builds_the_file_the_readme_installs(tmp_path):
    build, install = next(c for c in commands() if c.startswith("pip wheel")).split(" && ")
    wheel = install.split()[-1]
    assert wheel == f"dist/accel_ds_fix-{accel_ds_fix.__version__}-py3-none-any.whl"
    # The build as written, in a copy of the sources (no dist/ in the checkout), with this venv's pip.
    subprocess.run(["cp", "-r", *[str(ROOT / p) for p in ("setup.py", "setup.cfg", "pyproject.toml", "README.md",
                                                         "accel_ds_fix")], str(tmp_path)], check=True)
    proc = subprocess.run(build.replace("pip", f"{BIN / 'python'} -m pip", 1), shell=True, cwd=tmp_path,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with zipfile.ZipFile(tmp_path / wheel) as built:
        assert "accel_ds_fix.pth" in built.namelist() and "accel_ds_fix/cli/commands.py" in built.namelist()


def test_demo_fails_without_the_fix_and_trains_with_it():
    proc = subprocess.run([ROOT / "scripts" / "demo.sh"], capture_output=True, text=True, env=clean_env(), timeout=1800)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "AssertionError: You can't use same `Accelerator()` instance with multiple models" in proc.stdout
    assert "OK: fails without the fix, trains with it" in proc.stdout
    assert "accel_ds_fix: merged 2 models into one DeepSpeed engine (ZeRO stage 2)" in proc.stderr


def test_harmless_shell_commands_run_as_written(tmp_path):
    for command in run_by("test_harmless_shell_commands_run_as_written"):
        out = shell(command, tmp_path).stdout.strip()
        assert re.fullmatch(r"\d+|unlimited", out), (command, out)


def test_startup_bench_runs():
    proc = run([BIN / "python", ROOT / "bench" / "startup.py", "--pairs", "3"], env=clean_env())
    assert "cost of the variable: median" in proc.stdout and "ratio set/unset: median" in proc.stdout


def test_nvme_commands_run_as_written(tmp_path):
    # The plan that measures the NVMe folder (made by the mkdir before it, removed again here) and predicts 1600 steps.
    plans = run_by("test_nvme_commands_run_as_written")
    for plan in (c for c in plans if "--nvme-path" in c):
        folder = Path(plan.split("--nvme-path")[1].split()[0])
        existed = folder.exists()
        try:
            for make in (c for c in plans if c == f"mkdir -p {folder}"):
                shell(make, tmp_path)
            out = shell(plan, tmp_path).stdout
        finally:
            if not existed:
                shutil.rmtree(folder, ignore_errors=True)
        if nvme_unavailable():
            assert "NVMe folder not measured: zero3-nvme cannot run here" in out
        else:
            assert f"NVMe folder {folder}: its disk reads " in out and "hours for 1600 steps" in out
    # clean-swap on the shipped folder: only what dead runs left goes (nothing here, or a killed test run's files)
    for clean in (c for c in plans if c.startswith("python -m accel_ds_fix clean-swap")):
        folder = Path(clean.split()[-1])
        made = not folder.exists()
        folder.mkdir(parents=True, exist_ok=True)
        try:
            assert f"of NVMe swap files that dead runs left in {folder}" in shell(clean, tmp_path).stdout
        finally:
            if made:
                shutil.rmtree(folder, ignore_errors=True)
    # get-libaio, into a cache folder of this test's own (it writes to the user's cache as written).
    fetch = next(c for c in plans if c.startswith("python -m accel_ds_fix get-libaio"))
    env = clean_env(XDG_CACHE_HOME=str(tmp_path))
    env.pop("ACCEL_DS_FIX_LIBAIO", None)  # the set-up's own folder: the command as a user runs it uses the cache
    proc = run([BIN / "python", *fetch.split()[1:]], env=env, check=False)
    if libaio.on_system():
        assert proc.returncode == 0 and "the system has it" in proc.stdout
    elif shutil.which("apt-get"):
        assert proc.returncode == 0, proc.stderr
        assert (tmp_path / "accel_ds_fix" / "libaio" / "usr" / "include" / "libaio.h").exists()
    else:
        assert proc.returncode == 1 and "cannot fetch libaio here" in proc.stderr


# ---- links, paths, shape ----------------------------------------------------------------------------------------

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def prose(page):
    """The page without its fenced blocks and inline code (links and paths there are not links)."""
    text = FENCE.sub("", page.read_text())
    return re.sub(r"``.*?``|`[^`\n]*`", "", text)


def anchors(page):
    """The heading anchors GitHub makes: lower case, punctuation dropped, spaces to hyphens, -1, -2 on repeats."""
    seen, found = {}, set()
    for heading in re.findall(r"^#+ (.*)$", FENCE.sub("", page.read_text()), re.M):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
        slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return found


@pytest.mark.quick
def test_every_relative_link_leads_to_a_file_and_heading():
    for page in PAGES:
        for target in LINK.findall(prose(page)):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            assert linked.exists(), f"{page.relative_to(ROOT)}: {target}"
            if anchor:
                assert linked.suffix == ".md" and anchor in anchors(linked), f"{page.relative_to(ROOT)}: {target}"


# Files the measurement record names as they were when it measured, gone since.
FORMER = {"configs/ds_zero2_offload_6gb.json": "the config of runs 2 - 4, today's zero2-offload tier"}


@pytest.mark.quick
def test_files_and_links_the_pages_name_exist():
    # Paths from the checkout's root, in any page; the record also names third-party paths (diffusers' examples/).
    for page in PAGES:
        for path in set(re.findall(r"\b((?:configs|docs|bench|scripts|examples|tests|accel_ds_fix)/[\w./-]+\."
                                   r"(?:yaml|json|md|py|sh))", page.read_text())):
            parts = path.split("/")
            if page in RECORD and (path in FORMER or len(parts) > 2 and not (ROOT / parts[0] / parts[1]).exists()):
                continue
            assert (ROOT / path).exists(), f"{page.relative_to(ROOT)}: {path}"
    # The package's modules, named from inside accel_ds_fix/ (`merge/prepare.py`) in the user pages.
    for page in [README, *GUIDE]:
        for path in set(re.findall(r"(?<![\w/])((?:checkpoints|cli|memory|merge|nvme|ops|patches)/\w+\.py)",
                                   page.read_text())):
            assert (ROOT / "accel_ds_fix" / path).exists(), f"{page.relative_to(ROOT)}: {path}"


@pytest.mark.quick
def test_readme_is_short_and_every_guide_page_starts_with_its_command():
    lines = README.read_text().splitlines()
    assert len(lines) <= 150, len(lines)
    first = next(i for i, line in enumerate(lines) if line.startswith("```bash"))
    assert first < 40, f"the README's first command is on line {first + 1}: below the first screen"
    for page in GUIDE:
        body = [line for line in page.read_text().splitlines() if line.strip() and not line.startswith("# ")]
        assert body[0].startswith("```"), f"{page.relative_to(ROOT)} does not start with its command"
    for page in [README, *GUIDE]:  # prose lines at most 120 characters (tables and blocks may be wider)
        long = [line for line in FENCE.sub("", page.read_text()).splitlines()
                if len(line) > 120 and not line.startswith("|")]
        assert not long, f"{page.relative_to(ROOT)}: {long[0][:60]}..."
