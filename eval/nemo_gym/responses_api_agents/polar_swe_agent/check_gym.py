"""Validate this agent's example rows and rollouts with NeMo Gym's own models; optionally run /run for real.

    cd eval/nemo_gym/responses_api_agents/polar_swe_agent
    GYM_VENV/bin/python check_gym.py [--service URL [--token-file FILE]]

Runs in an interpreter where ``nemo-gym`` is installed: 0.7.0 on Python 3.13 (``python -m eval.nemo_gym.gym_root``
makes one, tests/.cache/gymvenv/bin/python); 0.4.0 on Python 3.12 still passes. Checks that every row of
data/example.jsonl parses as the agent's run request (``responses_create_params`` strictly), that every rollout of
data/example_rollouts.jsonl parses as Gym's BaseVerifyResponse, keeps its token fields through Gym's output item
models (the "ForTraining" variants) and carries the same ``mask_sample`` at the top (Gym >= 0.7 parses it) and in
``instance_config``. With ``--service``: app.py's web server, served by FastAPI's TestClient, serves every route of
Gym's agent base class; its /run returns such a response for the first row through that rollout service, and
/aggregate_metrics aggregates it. Prints one JSON line: what it checked.
"""

import argparse
import json
import sys
from pathlib import Path

import app
from fastapi.testclient import TestClient
from nemo_gym.base_resources_server import BaseVerifyResponse
from nemo_gym.base_responses_api_agent import SimpleResponsesAPIAgent
from nemo_gym.config_types import BaseServerConfig
from nemo_gym.server_utils import ServerClient
from omegaconf import OmegaConf

TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
HERE = Path(__file__).resolve().parent


def tokens(output):
    return [[item.get(k) for k in TOKEN_FIELDS] for item in output if item.get("generation_token_ids")]


def check_rollout(answer):
    gym = BaseVerifyResponse.model_validate(answer)
    parsed = app.PolarSWEVerifyResponse.model_validate(answer).model_dump(mode="json")
    if tokens(parsed["response"]["output"]) != tokens(answer["response"]["output"]):
        sys.exit("Gym's output item models dropped or changed token fields")
    mask = parsed["instance_config"]["mask_sample"]
    if not isinstance(mask, bool) or parsed.get("mask_sample") is not mask:
        sys.exit("mask_sample and instance_config.mask_sample are not the same bool")
    if getattr(gym, "mask_sample", mask) is not mask:  # a field of Gym's own model from 0.7 on
        sys.exit(f"Gym parsed mask_sample as {gym.mask_sample!r}, the answer says {mask!r}")
    return parsed


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--service", help="URL of a running rollout service: also run /run on the first row")
    parser.add_argument("--token-file", help="the service's bearer token file, if it has one")
    args = parser.parse_args()
    rows = [json.loads(line) for line in (HERE / "data" / "example.jsonl").read_text().splitlines()]
    rollouts = [json.loads(line) for line in (HERE / "data" / "example_rollouts.jsonl").read_text().splitlines()]
    for row in rows:
        app.PolarSWERunRequest.model_validate(row)
    for answer in rollouts:
        check_rollout(answer)
    report = {"rows": len(rows), "rollouts": len(rollouts)}
    if args.service:
        config = app.PolarSWEAgentConfig(
            name="polar_swe_agent",
            host="127.0.0.1",
            port=0,
            entrypoint="app.py",
            service_url=args.service,
            service_token_file=args.token_file,
            model_name="tiny",
            poll_s=0.5,
        )
        # The agent never calls other Gym servers; a client for an absent head server satisfies the base class.
        head = BaseServerConfig(host="127.0.0.1", port=9)
        client = ServerClient(head_server_config=head, global_config_dict=OmegaConf.create({}))
        agent = app.PolarSWEAgent(config=config, server_client=client)
        web = TestClient(agent.setup_webserver())
        routes = {(route.path, method) for route in web.app.routes for method in getattr(route, "methods", ())}
        base = SimpleResponsesAPIAgent.setup_webserver(agent).routes
        missing = {(r.path, m) for r in base for m in getattr(r, "methods", ())} - routes
        if missing:  # e.g. /aggregate_metrics, which Gym's environment server calls after a collection
            sys.exit(f"the agent does not serve these routes of Gym's agent base class: {sorted(missing)}")
        single = web.post("/v1/responses", json=rows[0]["responses_create_params"])
        if single.status_code != 501:  # no single turns: the harness owns them
            sys.exit(f"/v1/responses answered {single.status_code}, expected 501: {single.text[:500]}")
        response = web.post("/run", json=rows[0])
        if response.status_code != 200:
            sys.exit(f"/run answered {response.status_code}: {response.text[:2000]}")
        report["run"] = check_rollout(response.json())
        row = {"_ng_task_index": 0, "_ng_rollout_index": 0} | report["run"]
        aggregate = web.post("/aggregate_metrics", json={"verify_responses": [row]})
        if aggregate.status_code != 200:
            sys.exit(f"/aggregate_metrics answered {aggregate.status_code}: {aggregate.text[:2000]}")
        report["aggregate"] = aggregate.json()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
