"""Task environments: an NL2RepoBench-shaped task run and scored end to end inside its image,
and the command lines of the runtimes that cannot run on this machine."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from gyre.harness.evaluator import EvalOptions, evaluate_workspace
from gyre.harness.runner import HarnessPool
from gyre.harness.runtimes import ImageRef, Instance, Mount, get_runtime
from gyre.harness.sandbox import Environments, SandboxConfig
from gyre.harness.tasks import read_suite

from support import task_image

needs_image = pytest.mark.skipif(shutil.which("bwrap") is None or task_image.available() is not None,
                                 reason=f"bubblewrap or the test image's sources are missing: {task_image.available()}")

# The harness: inside the image it writes a candidate repository with 3 of the 4 functions right,
# packaging files and its own tests (both removed before scoring), and reports what it saw.
HARNESS = r'''
import json, os, sys, urllib.request
seen = {"python": sys.executable, "cwd": os.getcwd(), "hidden_tests_visible": os.path.exists("/workspace/tests/test_mini.py"),
        "readme_visible": os.path.exists("/workspace/README.md"), "task": sorted(os.listdir(os.environ["GYRE_TASK_DIR"])),
        "proxy": urllib.request.urlopen(os.environ["OPENAI_BASE_URL"] + "/ping").read().decode()}
open("/workspace/mini.py", "w").write("def add(a, b):\n    return a + b\ndef sub(a, b):\n    return a - b\n"
                                     "def mul(a, b):\n    return a * b\ndef div(a, b):\n    return 0\n")
open("/workspace/pyproject.toml", "w").write("[project]\nname = 'mini'\n")
os.makedirs("/workspace/tests", exist_ok=True)
open("/workspace/tests/test_fake.py", "w").write("def test_fake():\n    pass\n" * 1)
open("/workspace/seen.json", "w").write(json.dumps(seen))
'''


@pytest.fixture(scope="module")
def image_dir():
    if shutil.which("bwrap") is None or task_image.available() is not None:
        pytest.skip("no bubblewrap or no sources for the test image")
    return task_image.build_image_dir()


async def _serve_ping():
    from aiohttp import web

    from gyre.proxy.routes import start_site

    async def ping(request):
        return web.Response(text="pong")

    app = web.Application()
    app.router.add_get("/v1/ping", ping)
    return await start_site(app, "127.0.0.1", 0)


@needs_image
def test_nl2repo_task_runs_and_scores_inside_its_image(tmp_path, image_dir):
    suite = read_suite(task_image.nl2repo_suite(tmp_path / "NL2RepoBench"))
    task = suite.tasks[0]
    assert task.tests_dir is None and task.image == "ghcr.io/multimodal-art-projection/nl2repobench/mini:1.0"
    envs = Environments(SandboxConfig(image_dir=str(image_dir)))
    place = envs.place(task)
    assert (place.kind, place.runtime.name, place.scorable) == ("image", "bwrap", True)

    async def run():
        runner, port = await _serve_ping()
        try:
            pool = HarnessPool(tmp_path / "run", ["{python}", "-c", HARNESS], environments=envs)
            return await pool.run_execution(task, "mini-g0", api_key="k", base_url=f"http://127.0.0.1:{port}/v1")
        finally:
            await runner.cleanup()

    res = asyncio.run(run())
    ws = Path(res.workspace)
    assert res.status == "done", (res, (Path(res.log_dir) / "harness.stderr").read_text())
    seen = json.loads((ws / "seen.json").read_text())
    # the harness ran in the image (its Python), in its own /workspace, without the image's hidden tests
    assert seen["python"] == "/usr/bin/python3" and seen["cwd"] == "/workspace"
    assert not seen["hidden_tests_visible"] and not seen["readme_visible"]
    assert seen["task"] == ["start.md", "test_case_count.txt", "test_commands.json", "test_files.json"]
    assert seen["proxy"] == "pong"

    ev = evaluate_workspace(task, ws, res.status, EvalOptions(timeout_s=120, scratch_dir=str(tmp_path / "s"),
                                                             environments=envs), tmp_path / "eval.log")
    log = (tmp_path / "eval.log").read_text()
    assert (ev.reward, ev.official_reward, ev.passed, ev.total, ev.source) == (0.75, 0.75, 3, 4, "tests"), (ev, log)
    assert ev.environment.startswith("bwrap: ")
    assert "removed packaging file pyproject.toml" in log and "removed candidate test path tests" in log
    assert "$ pip install -e ." in log and "test_fake" not in log.split("$ pytest")[1]
    # the workspace itself is untouched by scoring
    assert (ws / "pyproject.toml").exists() and (ws / "tests" / "test_fake.py").exists()


@needs_image
def test_image_missing_is_unscorable_with_the_way_to_get_it(tmp_path, image_dir):
    suite = read_suite(task_image.nl2repo_suite(tmp_path / "s", task="other"))
    envs = Environments(SandboxConfig(image_dir=str(image_dir)))
    place = envs.place(suite.tasks[0])
    assert not place.scorable and "other.sif" in place.reason and "apptainer build" in place.reason
    ev = evaluate_workspace(suite.tasks[0], tmp_path, "done", EvalOptions(environments=envs))
    assert (ev.reward, ev.official_reward, ev.source) == (None, 0.0, "unscorable")


def _inst(image: ImageRef) -> Instance:
    return Instance(argv=["python3", "-S", "/gyre-lib/gyre_sandbox_init.py", "--", "agent"], workdir="/workspace",
                    mounts=[Mount("/runs/ws/e1", "/workspace", True), Mount("/runs/tasks/t", "/task")],
                    env={"OPENAI_API_KEY": "sk-secret", "GYRE_WORKSPACE": "/workspace"}, image=image, name="t-g0-a0")


def test_apptainer_command_line():
    la = get_runtime("apptainer").launch(_inst(ImageRef("apptainer", "/img/t.sif", "x")))
    assert la.argv[:2] == ["apptainer", "exec"]
    for flag in ("--containall", "--no-home", "--writable-tmpfs"):
        assert flag in la.argv
    assert la.argv[la.argv.index("--pwd") + 1] == "/workspace"
    assert ["--net", "--network", "none"] == la.argv[la.argv.index("--net"):la.argv.index("--net") + 3]
    assert "/runs/ws/e1:/workspace" in la.argv and "/runs/tasks/t:/task:ro" in la.argv
    assert la.argv[-6:] == ["/img/t.sif", "python3", "-S", "/gyre-lib/gyre_sandbox_init.py", "--", "agent"]
    assert la.env["APPTAINERENV_OPENAI_API_KEY"] == "sk-secret" and "sk-secret" not in " ".join(la.argv)
    sing = get_runtime("singularity").launch(_inst(ImageRef("singularity", "/img/t.sif", "x")))
    assert sing.argv[0] == "singularity" and "SINGULARITYENV_OPENAI_API_KEY" in sing.env


def test_enroot_command_line():
    la = get_runtime("enroot").launch(_inst(ImageRef("enroot", "/img/t.sqsh", "x")))
    assert la.setup == [["enroot", "create", "--name", "t-g0-a0", "/img/t.sqsh"]]
    assert la.teardown == [["enroot", "remove", "--force", "t-g0-a0"]]
    assert la.argv[:3] == ["enroot", "start", "--rw"]
    assert "/runs/ws/e1:/workspace:none:x-create=auto,rbind" in la.argv
    assert "/runs/tasks/t:/task:none:x-create=auto,rbind,ro" in la.argv
    assert ["--env", "OPENAI_API_KEY"] == la.argv[la.argv.index("OPENAI_API_KEY") - 1:la.argv.index("OPENAI_API_KEY") + 1]
    assert "sk-secret" not in " ".join(la.argv) and la.env["OPENAI_API_KEY"] == "sk-secret"
    assert "t-g0-a0" in la.argv and la.argv[-5:] == ["python3", "-S", "/gyre-lib/gyre_sandbox_init.py", "--", "agent"]


@pytest.mark.parametrize("program", ["podman", "docker"])
def test_oci_command_line(program):
    la = get_runtime(program).launch(_inst(ImageRef(program, "ghcr.io/x/t:1.0", "ghcr.io/x/t:1.0")))
    assert la.argv[:4] == [program, "run", "--rm", "-i"]
    assert la.argv[la.argv.index("--network") + 1] == "none"
    assert ("--pid" in la.argv) == (program == "podman")  # docker's default pid namespace is private
    assert "/runs/ws/e1:/workspace" in la.argv and "/runs/tasks/t:/task:ro" in la.argv
    assert ["-e", "OPENAI_API_KEY"] == la.argv[la.argv.index("OPENAI_API_KEY") - 1:la.argv.index("OPENAI_API_KEY") + 1]
    assert "sk-secret" not in " ".join(la.argv)
    assert la.teardown == [[program, "rm", "--force", "gyre-t-g0-a0"]]


def test_image_lookup_by_file(tmp_path):
    (tmp_path / "a.sif").write_bytes(b"sif")
    (tmp_path / "b.sqsh").write_bytes(b"sqsh")
    (tmp_path / "c" / "usr").mkdir(parents=True)
    assert get_runtime("apptainer").locate("img/a", "a", str(tmp_path))[0].location == str(tmp_path / "a.sif")
    assert get_runtime("enroot").locate("img/b", "b", str(tmp_path))[0].location == str(tmp_path / "b.sqsh")
    assert get_runtime("bwrap").locate("img/c", "c", str(tmp_path))[0].location == str(tmp_path / "c")
    ref, why = get_runtime("enroot").locate("ghcr.io/m/n2r/a:1.0", "a", str(tmp_path))
    assert ref is None and "enroot import" in why and "docker://ghcr.io#m/n2r/a:1.0" in why
