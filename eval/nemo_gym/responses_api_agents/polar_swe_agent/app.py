"""NeMo Gym agent server for Polar: ``/run`` hands a SWE task to polar-rl's rollout service and answers Gym's verify
response with the swebench reward and the main chain's exact token ids (polar_gym.py does the reshaping).

    NEMO_GYM_EXTRA_ROOTS=$PWD/eval/nemo_gym gym env start \\
        "+config_paths=[responses_api_agents/polar_swe_agent/configs/polar_swe_agent.yaml]" \\
        ++polar_swe_agent.responses_api_agents.polar_swe_agent.service_url=http://127.0.0.1:8090 \\
        ++policy_model_name=MODEL

Started by Gym in its own virtualenv (requirements.txt), as ``python app.py`` in this folder, behind the
``legacy_agent`` environment server the config declares. The rollout service (``python -m eval serve-rollouts``)
and the capture proxy in front of the policy model run beside it; see eval/nemo_gym/README.md. Every route of
Gym 0.7's agent base class is served (its ``setup_webserver``: the session middleware, ``/run``,
``/aggregate_metrics``, ``/v1/agent_sessions``, the traced ``/v1/responses``); ``/v1/responses`` answers 501: the
harness owns the agent loop (Gym's external-agent-loop profile).
"""

import asyncio
from pathlib import Path
from typing import Any, ClassVar

from fastapi import Body, HTTPException
from nemo_gym.base_resources_server import BaseRunRequest, BaseVerifyResponse
from nemo_gym.base_responses_api_agent import BaseResponsesAPIAgentConfig, SimpleResponsesAPIAgent
from nemo_gym.openai_utils import NeMoGymResponse, NeMoGymResponseCreateParamsNonStreaming
from polar_gym import ServiceClient, check_runtime, submission, verify_response
from pydantic import ConfigDict, field_validator


class PolarSWEAgentConfig(BaseResponsesAPIAgentConfig):
    service_url: str
    """polar-rl rollout service, e.g. http://127.0.0.1:8090."""
    service_token_file: str | None = None
    """File with the service's bearer token (its --token-file), if it has one."""
    harness: str = "mini"
    """Harness preset run on each task, unless a row's metadata.harness says otherwise."""
    model_name: str = "policy"
    """Model name the harness asks the proxy for, unless a row's responses_create_params.model says otherwise."""
    runtime: str | None = None
    """Where the service runs each session (polar_gym.RUNTIMES): "docker" in the task's own container with no
    network but its proxy, "local" on the service's machine (unsandboxed); null: the service's --runtime."""
    rollout_timeout_s: float = 1800.0
    """Seconds before the service kills a harness (session status timeout, sample masked)."""
    run_deadline_s: float = 7200.0
    """Seconds /run waits for the service's job (queue, harness, grading, reconstruction) before cancelling it."""
    poll_s: float = 2.0
    """Seconds between job status polls."""

    @field_validator("runtime")
    @classmethod
    def _known_runtime(cls, runtime: str | None) -> str | None:
        return check_runtime(runtime)  # an unknown one stops Gym at start, not at every /run


class PolarSWERunRequest(BaseRunRequest):
    model_config = ConfigDict(extra="allow")  # the SWE instance (or instance_id) and Gym's _ng_* indices


class PolarSWEVerifyResponse(BaseVerifyResponse):
    # Gym 0.7's own mask_sample, failure_kind and failure_reason; beside them resolved, model_patch,
    # instance_config.mask_sample (for Gym before 0.7) and polar.
    model_config = ConfigDict(extra="allow")


class PolarSWEAgent(SimpleResponsesAPIAgent):
    config: PolarSWEAgentConfig
    ray_enabled: ClassVar[bool | None] = False  # Gym >= 0.7 asks; the agent only talks HTTP to the service
    # No setup_webserver of its own: the base class's serves every route Gym calls, /aggregate_metrics included
    # (the environment server forwards it here after a collection; its default aggregates the rewards).

    async def responses(self, body: NeMoGymResponseCreateParamsNonStreaming = Body()) -> NeMoGymResponse:
        # Gym's agent interface has a single-turn route; this agent has no turns to give: the harness runs the
        # whole session through the proxy. The caller gets a clear 501, not a server error.
        raise HTTPException(
            status_code=501, detail="polar_swe_agent runs whole rollouts: POST /run; single turns belong to the harness"
        )

    async def run(self, body: PolarSWERunRequest = Body()) -> PolarSWEVerifyResponse:
        row: dict[str, Any] = body.model_dump(mode="json", exclude_unset=True)
        token_file = self.config.service_token_file
        client = ServiceClient(
            self.config.service_url,
            token=Path(token_file).read_text().strip() if token_file else None,
            poll_s=self.config.poll_s,
        )
        config = self.config
        job = submission(
            row,
            harness=config.harness,
            model=config.model_name,
            timeout=config.rollout_timeout_s,
            runtime=config.runtime,
        )
        results = await asyncio.to_thread(client.run, job, deadline_s=self.config.run_deadline_s)
        answer = verify_response(row, results, model=self.config.model_name)
        answer["responses_create_params"] = body.responses_create_params  # echoed as Gym parsed it
        return PolarSWEVerifyResponse.model_validate(answer)


if __name__ == "__main__":
    PolarSWEAgent.run_webserver()
