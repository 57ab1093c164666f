"""mini-swe-agent (pip install mini-swe-agent), an open-source coding agent, as a Gyre harness.

Its text-based configuration (mini_textbased.yaml: one ```mswea_bash_command block per reply) runs
unchanged; only the model endpoint is Gyre's proxy (litellm's `openai/` provider, the proxy's /v1
URL, this execution's key) and the shell works in the execution's workspace.
"""

import os
from pathlib import Path

import yaml

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network at import
os.environ.setdefault("MSWEA_COST_TRACKING", "ignore_errors")  # a local model has no price
from minisweagent.agents.default import DefaultAgent  # noqa: E402
from minisweagent.config import get_config_path  # noqa: E402
from minisweagent.environments.local import LocalEnvironment  # noqa: E402
from minisweagent.models.litellm_textbased_model import LitellmTextbasedModel  # noqa: E402


def main() -> None:
    ws = Path(os.environ.get("GYRE_WORKSPACE", "."))
    cfg = yaml.safe_load(get_config_path("mini_textbased").read_text())
    agent_cfg = {k: v for k, v in cfg["agent"].items() if k != "mode"}  # `mode` is the interactive agent's
    model = LitellmTextbasedModel(
        model_name="openai/main", cost_tracking="ignore_errors",
        model_kwargs={**cfg["model"].get("model_kwargs", {}), "api_base": os.environ["OPENAI_BASE_URL"],
                      "api_key": os.environ["OPENAI_API_KEY"], "max_tokens": 512},
        **{k: v for k, v in cfg["model"].items() if k in ("observation_template", "format_error_template")})
    env = LocalEnvironment(cwd=str(ws), env=cfg.get("environment", {}).get("env", {}), timeout=60)
    agent = DefaultAgent(model, env, **{**agent_cfg, "step_limit": 20})
    task = (ws / "start.md").read_text() if (ws / "start.md").is_file() else "Create hello.txt saying hello."
    result = agent.run(task)
    print(f"mini-swe-agent: {result.get('exit_status')}")


if __name__ == "__main__":
    main()
